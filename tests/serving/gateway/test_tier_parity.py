"""``kvmeter serve`` and ``kvmeter simulate`` follow one tier policy: for the same request of each
tier, the gateway's path (HTTP → the scheduler ``Job`` it builds → the grant) and the simulator's
(trace request → its ``Job`` → the grant) derive the same deadline and the same engine priority.

Serve: a real uvicorn server with the instant engine over the model's tokenizer, the tenants file
below, the fair scheduler; the grant each request got is read at the scheduler boundary. Simulate:
the discrete-event simulator with the scheduler config built from the same tenants file.
"""

from __future__ import annotations

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.serving.config import load_serve_config
from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.serving.gateway.app import create_app
from kvmeter.serving.runtime import ServeRuntime, scheduler_config_from_tiers
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.traces import TraceRequest
from tests.conftest import free_port, start_uvicorn
from tests.serving.gateway.conftest import MemoryRecorder

# One org per tier: the four built-ins (free with its own deadline factor, batch with its own
# maximum queue wait) and a tier the file adds.
TENANTS = """
version: 1
default_tier: free
tiers:
  free: {deadline_slo_factor: 2}
  batch: {max_queue_wait_s: 900}
  research: {weight: 2, priority: 5, ttft_slo_s: 4, deadline_slo_factor: 1.5}
orgs:
""" + "".join(f"""  org-{tier}:
    tier: {tier}
    workspaces: {{w: {{projects: {{p: {{api_keys: {{key-{tier}: {{key: sk-parity-{tier}}}}}}}}}}}}}
""" for tier in ("enterprise", "paid_interactive", "batch", "free", "research"))

#: deadline − arrival (seconds) and engine priority each tier's request must get, from the rules:
#: max_queue_wait_s, else deadline_slo_factor × ttft_slo_s (built-in SLOs 1 s, 2 s, 5 s; factor 3).
EXPECTED = {"enterprise": (3.0, 0), "paid_interactive": (6.0, 1), "batch": (900.0, 2), "free": (10.0, 3),
            "research": (6.0, 5)}


async def _serve_grants(tenants_path, model_dir) -> dict[str, tuple[float, int]]:
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine

    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port,
                                      ("tenants",): str(tenants_path)}, env={})
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, max_model_len=4096)
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    runtime.gateway.recorder = MemoryRecorder()
    grants = []
    acquire = runtime.scheduler.acquire

    async def recorded(job):  # the real scheduler's grant, seen at the gateway's boundary
        grant = await acquire(job)
        grants.append(grant)
        return grant

    runtime.scheduler.acquire = recorded
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = await start_uvicorn(server)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for tier in EXPECTED:
                resp = await client.post("/v1/chat/completions",
                                         headers={"authorization": f"Bearer sk-parity-{tier}"},
                                         json={"model": engine.model_name, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 200, resp.text
    finally:
        server.should_exit = True
        await task
        runtime.exporter.close()
        await engine.shutdown()
    return {g.job.tier: (g.job.deadline_s - g.job.arrival_s, g.priority) for g in grants}


def _simulated(tenants_path) -> dict[str, tuple[float, int]]:
    scfg = scheduler_config_from_tiers(TenantDirectory.from_file(tenants_path))
    trace = [TraceRequest(arrival_s=float(i), input_tokens=32, output_tokens=4, tenant_id=f"org-{tier}", tier=tier)
             for i, tier in enumerate(EXPECTED)]
    result = Simulation(trace, scheduler_config=scfg, sim=SimConfig(model="llama-2-7b", gpu="h100", tp=1)).run()
    assert all(r.outcome == "ok" for r in result.records), [(r.tier, r.outcome, r.reason) for r in result.records]
    return {r.tier: (r.deadline_s - r.arrival_s, r.priority) for r in result.records}


async def test_serve_and_simulate_give_each_tier_the_same_deadline_and_priority(tmp_path, model_dir):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    served = await _serve_grants(path, model_dir)
    simulated = _simulated(path)
    assert served.keys() == simulated.keys() == EXPECTED.keys()
    for tier, (deadline, priority) in EXPECTED.items():
        assert served[tier][0] == pytest.approx(deadline, abs=1e-6), tier
        assert simulated[tier][0] == pytest.approx(deadline, abs=1e-9), tier
        assert served[tier][1] == simulated[tier][1] == priority, tier
