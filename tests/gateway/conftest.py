"""A real ``kvmeter serve`` stack on loopback: uvicorn + the session's vLLM engine + a chDB ledger."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.serving.config import load_serve_config
from kvmeter.serving.runtime import ServeRuntime
from tests.conftest import free_port

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
        result = self.ledger._query_holder.get().query(sql, parameters=params)
        return [dict(zip(result.column_names, row)) for row in result.result_rows]

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
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started:
            break
        await asyncio.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield Stack(runtime, f"http://127.0.0.1:{port}")
    server.should_exit = True
    await task


@pytest.fixture
async def client(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        yield c


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}
