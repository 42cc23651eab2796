"""Several models behind one gateway (``engine.models``, issue 17 item 1): an engine pool per model
of real OpenAI-compatible replicas on loopback (``scripted_upstream``), driven with the official
``openai`` SDK through a real ``kvmeter serve`` stack (uvicorn, a fair scheduler per model, the
quota, a chDB ledger). Both models estimate with the bundled SmolLM2 tokenizer under two served
names. Each request reaches its own model's replicas; ``/v1/models`` lists both; an unknown model
is vLLM's 404 naming them; usage, prices, the spend quota, the pool metrics and the replicas API
are per model."""

from __future__ import annotations

from decimal import Decimal

import httpx
import openai
import pytest

from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.period import parse_period
from kvmeter.serving.config import ServeConfigError, load_serve_config
from tests.serving.quota_http.conftest import one_project_tenants
from tests.serving.quota_http.scripted_upstream import ScriptedUpstream, Whole

A, B = "smol-a", "smol-b"
KEY = "sk-test-models-001"
THRIFTY = "sk-test-models-thrifty"
ADMIN = "sk-test-models-admin"
CFG = one_project_tenants(
    f"k1: {{key: {KEY}}}",
    f'thrifty: {{key: {THRIFTY}, limits: {{spend_per_day: "0.001"}}}}',
    f"ops: {{key: {ADMIN}, admin: true}}",
)
#: USD per 1M tokens: model B costs a hundred times model A
PRICES = f"""
version: "test-models-1"
currency: USD
rounding: {{quantum: "0.000001", mode: ROUND_HALF_EVEN}}
tiers: {{}}
models:
  {A}: {{input: 1.00, cached_input: 0.50, output: 2.00}}
  {B}: {{input: 100.00, cached_input: 50.00, output: 200.00}}
"""
PERIOD = parse_period("2024-05")  # the stacks' ManualClock starts at 2024-05-17
PROMPT = [1000 + i for i in range(84)]


def answer(model: str, n_in: int = 84, n_out: int = 3) -> Whole:
    return Whole({"id": "cmpl-up", "object": "text_completion", "created": 1, "model": model,
                  "choices": [{"index": 0, "text": "ok" * n_out, "finish_reason": "length", "logprobs": None}],
                  "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})


async def upstreams() -> tuple[list[ScriptedUpstream], list[ScriptedUpstream]]:
    ups_a = [await ScriptedUpstream(A, answer=answer(A)).start() for _ in range(2)]
    ups_b = [await ScriptedUpstream(B, answer=answer(B), max_model_len=2048).start()]
    return ups_a, ups_b


def sdk(s, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture
async def two_models(serve, model_dir):
    ups_a, ups_b = await upstreams()
    models = [{"name": A, "model": str(model_dir), "replicas": [u.url for u in ups_a], "routing": "round_robin"},
              {"name": B, "model": str(model_dir), "replicas": [u.url for u in ups_b]}]
    try:
        s = await serve(CFG, models=models, prices_yaml=PRICES)
        yield s, ups_a, ups_b
    finally:
        for u in ups_a + ups_b:
            await u.stop()


async def test_each_request_reaches_its_models_pool_and_is_metered_and_priced_as_that_model(two_models):
    s, ups_a, ups_b = two_models
    client = sdk(s)
    listed = (await s.client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).json()
    assert [(m["id"], m["object"], m["max_model_len"]) for m in listed["data"]] == [(A, "model", 4096),
                                                                                  (B, "model", 2048)]
    assert [m.id async for m in client.models.list()] == [A, B]
    for _ in range(2):
        done = await client.completions.create(model=A, prompt=PROMPT, max_tokens=3)
        assert done.model == A and done.usage.prompt_tokens == 84
    done = await client.completions.create(model=B, prompt=PROMPT, max_tokens=3)
    assert done.model == B
    # A's requests went to A's replicas only (round robin: one each), B's to B's
    assert [len(u.bodies) for u in ups_a] == [1, 1] and len(ups_b[0].bodies) == 1
    assert {b["model"] for u in ups_a for b in u.bodies} == {A} and ups_b[0].bodies[0]["model"] == B
    # an unknown model: vLLM's 404 naming every served model, nothing sent upstream
    with pytest.raises(openai.NotFoundError, match=f"does not exist. Valid aliases: {A}, {B}."):
        await client.completions.create(model="smol-c", prompt=PROMPT, max_tokens=3)
    # no model: the first one's (as vLLM's server serves its model to a request without a name)
    resp = await s.client.post("/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                               json={"prompt": PROMPT, "max_tokens": 3})
    assert resp.status_code == 200 and [len(u.bodies) for u in ups_a] == [2, 1] and len(ups_b[0].bodies) == 1
    # metered under the request's model, and priced as it
    rows = s.billed(api_key_id="k1")
    assert sorted(r["model"] for r in rows) == [A, A, A, B]
    lines = {r["model"]: r for r in build_invoice(s.ledger.queries, PERIOD, s.ledger.prices, "acme").rows()
             if r["input_tokens"]}
    assert (lines[A]["input_tokens"], lines[A]["output_tokens"]) == (3 * 84, 3 * 3)
    assert (lines[B]["input_tokens"], lines[B]["output_tokens"]) == (84, 3)
    assert Decimal(lines[A]["cost"]) == Decimal("0.000270")  # (252 × 1 + 9 × 2) / 1e6
    assert Decimal(lines[B]["cost"]) == Decimal("0.009000")  # (84 × 100 + 3 × 200) / 1e6
    # the pool metrics carry each model
    reg = s.runtime.registry
    routed = {(m, u.url): reg.get_sample_value("kvmeter_replica_routed_requests_total", {"model": m, "replica": u.url})
              for m, ups in ((A, ups_a), (B, ups_b)) for u in ups}
    assert routed == {(A, ups_a[0].url): 2, (A, ups_a[1].url): 1, (B, ups_b[0].url): 1}
    assert reg.get_sample_value("kvmeter_router_decisions_requests_total",
                                {"model": B, "policy": "prefix_aware", "outcome": "prefix_miss"}) == 1
    assert reg.get_sample_value("kvmeter_replica_up", {"model": B, "replica": ups_b[0].url}) == 1
    # one scheduler per model: its own gates
    assert [sch.core.num_engines for sch in s.runtime.schedulers.values()] == [2, 1]


async def test_the_spend_quota_prices_each_request_as_its_model(two_models):
    s, ups_a, ups_b = two_models
    client = sdk(s, THRIFTY)
    # 84 input + 3 output tokens: 0.00009 USD on A, 0.009 on B, against 0.001 a day
    await client.completions.create(model=A, prompt=PROMPT, max_tokens=3)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.create(model=B, prompt=PROMPT, max_tokens=3)
    assert refused.value.status_code == 400  # priced as B: more than the whole day's limit
    assert "spend_per_day limit" in refused.value.message and "it needs 0.009, the limit is 0.001" in \
        refused.value.message
    assert len(ups_b[0].bodies) == 0 and sum(len(u.bodies) for u in ups_a) == 1
    assert [r["model"] for r in s.billed(api_key_id="thrifty")] == [A]


async def test_the_replicas_api_lists_and_drains_each_models_pool(two_models):
    s, ups_a, ups_b = two_models
    admin = {"authorization": f"Bearer {ADMIN}"}
    listed = (await s.client.get("/v1/replicas", headers=admin)).json()["data"]
    assert [(r["model"], r["replica"], r["index"], r["available"]) for r in listed] == [
        (A, ups_a[0].url, 0, True), (A, ups_a[1].url, 1, True), (B, ups_b[0].url, 0, True)]
    only_b = (await s.client.get("/v1/replicas", headers=admin, params={"model": B})).json()["data"]
    assert [r["replica"] for r in only_b] == [ups_b[0].url]
    resp = await s.client.get("/v1/replicas", headers=admin, params={"model": "smol-c"})
    assert resp.status_code == 404 and f"Valid aliases: {A}, {B}." in resp.json()["error"]["message"]
    # an index is ambiguous among two pools; a URL is not
    resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": ups_a[0].url})
    assert resp.status_code == 200 and (resp.json()["model"], resp.json()["draining"]) == (A, True)
    client = sdk(s)
    for _ in range(2):
        await client.completions.create(model=A, prompt=PROMPT, max_tokens=3)
    await client.completions.create(model=B, prompt=PROMPT, max_tokens=3)
    assert [len(u.bodies) for u in ups_a] == [0, 2] and len(ups_b[0].bodies) == 1  # B's pool untouched
    resp = await s.client.post("/v1/replicas/drain", headers=admin,
                               json={"replica": 0, "model": A, "draining": False})
    assert resp.status_code == 200 and resp.json()["available"] and resp.json()["replica"] == ups_a[0].url
    assert s.runtime.registry.get_sample_value("kvmeter_replica_available",
                                               {"model": A, "replica": ups_a[0].url}) == 1
    resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": "http://nowhere"})
    assert resp.status_code == 404 and f"pools of {A}, {B}" in resp.json()["error"]["message"]


def test_the_models_config_is_checked():
    url = "http://a:8000"
    ok = load_serve_config(None, {("engine", "kind"): "remote", ("engine", "models"): [
        {"name": A, "replicas": [url]}, {"name": B, "replicas": ["http://b"], "routing": "least_kv"}]}, env={})
    assert [(m.name, m.routing) for m in ok.engine.models] == [(A, None), (B, "least_kv")]
    one = {"name": A, "replicas": [url]}
    for overrides, message in [
        ({("engine", "models"): [one]}, "engine.models needs engine.kind: remote"),
        ({("engine", "kind"): "remote", ("engine", "models"): [one, {"name": A, "replicas": ["http://b"]}]},
         f"names '{A}' twice"),
        ({("engine", "kind"): "remote", ("engine", "models"): [one, {"name": B, "replicas": [url + "/"]}]},
         f"replica {url}/ is in the pools of both '{A}' and '{B}'"),
        ({("engine", "kind"): "remote", ("engine", "models"): [{"name": A, "replicas": [url, url]}]}, "twice"),
        ({("engine", "kind"): "remote", ("engine", "models"): [{"name": A, "replicas": []}]},
         "engine.models.0.replicas"),
        ({("engine", "kind"): "remote", ("engine", "models"): [{"name": A}]}, "engine.models.0.replicas"),
        ({("engine", "kind"): "remote", ("engine", "models"): [one], ("engine", "replicas"): ["http://b"]},
         "not both"),
        ({("engine", "kind"): "remote", ("engine", "models"): [one], ("engine", "remote_url"): "http://b"},
         "not both"),
        ({("engine", "kind"): "remote", ("engine", "models"): [{**one, "tokenizer": "x"}]},
         "engine.models.0.tokenizer"),
    ]:
        with pytest.raises(ServeConfigError, match=message):
            load_serve_config(None, overrides, env={})


async def test_an_unknown_model_reaches_no_replica_of_any_pool(two_models):
    """vLLM's 404 (``param: model``) before anything is reserved or sent."""
    s, ups_a, ups_b = two_models
    async with httpx.AsyncClient(base_url=s.base_url) as c:
        resp = await c.post("/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                            json={"model": "smol-c", "prompt": PROMPT, "max_tokens": 3})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert sum(len(u.bodies) for u in ups_a + ups_b) == 0


async def test_a_replicas_load_and_health_reach_its_own_models_gate(two_models):
    """Replica 0 of B reports: B's gate 0 takes it, A's gate 0 (another replica) does not."""
    from kvmeter.stats import EngineLoad, ReplicaHealth

    s, ups_a, ups_b = two_models
    gate_a, gate_b = (s.runtime.schedulers[m].core.engine_gates[0] for m in (A, B))
    s.runtime.bus.publish(EngineLoad(0.97, 1000, 3, 2, per_step=False, replica=0, model=B))
    assert (gate_b.load.kv_watermark_ratio, gate_b.capacity) == (0.97, 1000)
    assert gate_a.load.kv_watermark_ratio == 0.0
    s.runtime.bus.publish(ReplicaHealth(model=B, replica=ups_b[0].url, index=0, healthy=False, draining=False,
                                        reason="test"))
    assert not gate_b.available and gate_a.available


async def test_each_model_estimates_with_its_own_tokenizer_and_chat_template(serve, model_dir, tmp_path):
    """Model B's directory is SmolLM2's with another chat template (a long system preamble): the
    same chat is reserved as each model's own template renders it."""
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.gateway.remote_path import chat_prompt_ids

    other = tmp_path / "smol-b-dir"
    other.mkdir()
    for f in model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (other / f.name).symlink_to(f)
    preamble = "You are model B, a careful assistant who answers in French. " * 8
    (other / "chat_template.jinja").write_text(preamble + (model_dir / "chat_template.jinja").read_text())
    ups_a, ups_b = [await ScriptedUpstream(A, answer=answer(A)).start()], [await ScriptedUpstream(B, answer=answer(B))
                                                                           .start()]
    try:
        s = await serve(CFG, prices_yaml=PRICES, models=[
            {"name": A, "model": str(model_dir), "replicas": [ups_a[0].url]},
            {"name": B, "model": str(other), "replicas": [ups_b[0].url]}])
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        for model in (A, B):
            resp = await s.client.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                       json={"model": model, "messages": chat, "max_tokens": 3})
            assert resp.status_code == 200, resp.text
        reserved = {r["model"]: r["reserved_input_tokens"] for r in s.attempts(api_key_id="k1")}
        expected = {m: len(chat_prompt_ids(HFTokenizer(d), chat)) for m, d in ((A, model_dir), (B, other))}
        assert reserved == expected and expected[B] > expected[A] + 50
    finally:
        for u in ups_a + ups_b:
            await u.stop()


async def test_each_models_own_window_holds_before_its_replicas(serve, model_dir):
    """A pool's ``max_model_len`` (here below what its replica reports, and it checks nothing):
    a prompt past it is vLLM's 400 naming that model's window, never sent, never billed; the other
    model's larger window takes the same prompt; one that fits is a 200."""
    ups_a, ups_b = await upstreams()
    models = [{"name": A, "model": str(model_dir), "replicas": [u.url for u in ups_a]},
              {"name": B, "model": str(model_dir), "replicas": [u.url for u in ups_b], "max_model_len": 80}]
    try:
        s = await serve(CFG, models=models, prices_yaml=PRICES)
        client = sdk(s)
        listed = (await s.client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})).json()
        assert {m["id"]: m["max_model_len"] for m in listed["data"]} == {A: 4096, B: 80}
        with pytest.raises(openai.BadRequestError, match="maximum context length is 80 tokens. However, your "
                                                         "prompt contains 84 input tokens"):
            await client.completions.create(model=B, prompt=PROMPT, max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="max_tokens=81 cannot be greater than max_model_len=80"):
            await client.completions.create(model=B, prompt=PROMPT[:10], max_tokens=81)
        assert ups_b[0].bodies == [] and s.billed(api_key_id="k1") == []
        done = await client.completions.create(model=B, prompt=PROMPT[:70], max_tokens=3)
        assert done.model == B and ups_b[0].bodies[-1]["max_tokens"] == 3
        await client.completions.create(model=B, prompt=PROMPT[:70], max_tokens=50)  # lowered to what is left
        assert ups_b[0].bodies[-1]["max_tokens"] == 10
        done = await client.completions.create(model=A, prompt=PROMPT, max_tokens=3)
        assert done.model == A and sum(len(u.bodies) for u in ups_a) == 1
        assert sorted(r["model"] for r in s.billed(api_key_id="k1")) == [A, B, B]
    finally:
        for u in ups_a + ups_b:
            await u.stop()


async def test_a_pool_that_cannot_start_stops_the_pools_started_before_it(tmp_path, model_dir):
    """Start-up with several models: the second pool's only replica does not answer, so start()
    fails — and the first pool, already started, is shut down (its connections closed), not left
    open. Before, every pool but the first was shut down: the started one leaked."""
    from prometheus_client import CollectorRegistry

    from kvmeter.net import free_port
    from kvmeter.serving.engines.base import EngineError
    from kvmeter.serving.runtime import ServeRuntime

    live = await ScriptedUpstream(A, answer=answer(A)).start()
    (tmp_path / "tenants.yaml").write_text(CFG)
    (tmp_path / "prices.yaml").write_text(PRICES)
    try:
        config = load_serve_config(None, {
            ("engine", "kind"): "remote", ("engine", "remote_metrics_url"): "off",
            ("engine", "models"): [{"name": A, "model": str(model_dir), "replicas": [live.url]},
                                   {"name": B, "model": str(model_dir),
                                    "replicas": [f"http://127.0.0.1:{free_port()}"]}],
            ("tenants",): str(tmp_path / "tenants.yaml"), ("prices",): str(tmp_path / "prices.yaml"),
            ("ledger_dsn",): f"chdb://{tmp_path}/chdb", ("spool_dir",): str(tmp_path / "spool")}, env={})
        runtime = ServeRuntime(config, registry=CollectorRegistry())
        first, second = (m.engine for m in runtime.models)
        with pytest.raises(EngineError):
            await runtime.start()
        assert all(r.client.is_closed for r in first.replicas)
        assert not any(r.client.is_closed for r in second.replicas)  # it never started: as before
        for r in second.replicas:
            await r.shutdown()
    finally:
        await live.stop()
