"""Real ``kvmeter serve`` stacks on loopback.

``stack``: uvicorn + the session's vLLM engine + a chDB ledger (slow to start: one per session).
``instant_stack``: uvicorn + the instant engine over the real tokenizer + an in-memory recorder that
validates every record exactly as the ledger does (no chDB: the process holds one chDB path at a
time, and ``stack`` holds it for the whole package), for behaviour that does not depend on vLLM.
"""

from __future__ import annotations

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.events import UsageEvent
from kvmeter.exporters.prometheus import metrics_asgi_app
from kvmeter.ledger.records import AttemptRecord, encode_attempt, encode_usage
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.gateway.app import create_app
from kvmeter.serving.gateway.tools import tool_call_routes
from kvmeter.serving.runtime import ServeRuntime
from tests.conftest import free_port, start_uvicorn

KEYS = {
    "acme": "sk-demo-acme-0001",          # enterprise
    "globex": "sk-demo-globex-0001",      # paid_interactive
    "umbrella": "sk-demo-umbrella-0001",  # paid_interactive
    "hobbyist": "sk-demo-hobbyist-0001",  # free
    "admin": "sk-demo-admin-0001",
}


class Stack:
    """The running server and handles into its parts."""

    def __init__(self, runtime: ServeRuntime, base_url: str) -> None:
        self.runtime = runtime
        self.base_url = base_url
        self.model = runtime.engine.model_name

    @property
    def ledger(self):
        return self.runtime.recorder.ledger

    def rows(self, sql: str, **params) -> list[dict]:
        """Run a read query on the ledger after draining the spool (FINAL = billed view)."""
        assert self.ledger.flush(30.0), "ledger did not drain"
        result = self.ledger.query_client().query(sql, parameters=params)
        return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]

    def usage(self, request_id: str) -> list[dict]:
        return self.rows("SELECT * FROM usage_events FINAL WHERE request_id = {rid:String}", rid=request_id)

    def usage_count(self, tenant: str) -> int:
        return self.rows("SELECT count() AS n FROM usage_events FINAL WHERE tenant_id = {t:String}", t=tenant)[0]["n"]


@pytest.fixture(scope="package")  # chDB holds one path per process: release it with the package
async def stack(vllm_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = load_serve_config(None, {
        ("server", "port"): port, ("ledger_dsn",): f"chdb://{root}/chdb", ("spool_dir",): str(root / "spool"),
    }, env={})
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=vllm_engine, bus=vllm_engine.test_bus)
    server = uvicorn.Server(uvicorn.Config(runtime.app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = await start_uvicorn(server)
    yield Stack(runtime, f"http://127.0.0.1:{port}")
    server.should_exit = True
    await task


class MemoryRecorder:
    """The gateway's recorder, in memory: each record is validated by the ledger's own encoders
    (an invalid one raises :class:`~kvmeter.ledger.errors.InvalidRecord`, as ``Ledger.record``
    does) and kept."""

    def __init__(self) -> None:
        self.events: list[UsageEvent] = []
        self.attempts: list[AttemptRecord] = []

    async def record(self, event: UsageEvent) -> None:
        encode_usage(event)
        self.events.append(event)

    async def record_attempt(self, attempt: AttemptRecord) -> None:
        encode_attempt(attempt)
        self.attempts.append(attempt)

    def attempt(self, request_id: str) -> AttemptRecord:
        (found,) = [a for a in self.attempts if a.request_id == request_id]
        return found

    def billed(self, tenant: str) -> int:
        return sum(1 for e in self.events if e.tenant_id == tenant)


class InstantStack:
    """The instant-engine server and handles into its parts."""

    def __init__(self, runtime: ServeRuntime, recorder: MemoryRecorder, port: int) -> None:
        self.runtime = runtime
        self.recorder = recorder
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.model = runtime.engine.model_name


@pytest.fixture(scope="package")
async def instant_stack(model_dir):
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine

    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port}, env={})
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, max_model_len=4096)
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    recorder = MemoryRecorder()
    runtime.gateway.recorder = recorder
    app = create_app(runtime.gateway, extra_routes=tool_call_routes(runtime.gateway, runtime.quota),
                     metrics_app=metrics_asgi_app(runtime.registry),
                     on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    # log_config=None: uvicorn's records reach the root logger (and caplog) like everyone else's
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info",
                                           log_config=None, lifespan="on"))
    task = await start_uvicorn(server)
    yield InstantStack(runtime, recorder, port)
    server.should_exit = True
    await task
    runtime.exporter.close()
    await engine.shutdown()


@pytest.fixture
async def client(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        yield c


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}
