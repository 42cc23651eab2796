"""A real ``kvmeter serve`` stack per test for the quota's HTTP surface.

Each test starts :class:`~kvmeter.serving.runtime.ServeRuntime` under a real uvicorn on loopback
with its own principals YAML (tight limits) and price list written to ``tmp_path``, the
``instant`` engine over the model's real tokenizer (no inference, exact token counts), the real
fair scheduler and a real chDB ledger. Time that drives the quota (GCRA refill, spend periods, run
runtime) comes from an injected :class:`~kvmeter.clock.ManualClock`, moved by the test.

chDB hosts one engine path per process, so a stack's ledger is closed when its test ends, before
the next test opens its own; do not run this folder in the same pytest process as a fixture that
keeps another chDB path open for the whole session (``tests/serving/gateway``'s ``stack``).
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.ledger.queries import BILLED_CLASSES, classified_usage_sql
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.base import Engine
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.serving.engines.instant import InstantEngine
from kvmeter.serving.runtime import ServeRuntime
from tests.conftest import free_port, run_async_tests_on_session_loop, start_uvicorn
from tests.serving.gateway.conftest import Stack

#: 2024-05-17 12:00:00 UTC — mid-day, mid-month: the next UTC midnight is 12 h away.
T0_WALL = 1_715_947_200.0
MODEL = "SmolLM2-135M-Instruct"

#: Exact per-token prices for the tests' price list (USD per 1M tokens): input 1.00, output 2.00,
#: so a prompt of p tokens with c completion tokens costs (p + 2c) / 1e6.
PRICES_YAML = f"""
version: "test-1"
currency: USD
rounding: {{quantum: "0.000001", mode: ROUND_HALF_EVEN}}
tiers: {{}}
models:
  {MODEL}: {{input: 1.00, cached_input: 0.50, output: 2.00}}
"""


def tenants(body: str, *, extra_top: str = "") -> str:
    """A principals YAML: ``body`` is indented under ``orgs:``."""
    return f"version: 1\ndefault_tier: paid_interactive\n{extra_top}\norgs:\n" + textwrap.indent(
        textwrap.dedent(body).strip("\n"), "  ") + "\n"


def one_project_tenants(*api_keys: str) -> str:
    """A principals YAML of one org ``acme`` (workspace ``ws``, project ``p``) whose project holds
    ``api_keys``, each one YAML line ``name: {key: ..., ...}``."""
    lines = "".join(f"            {line}\n" for line in api_keys)
    return tenants("acme:\n  workspaces:\n    ws:\n      projects:\n        p:\n          api_keys:\n" + lines)


def completion(n_input: int, max_tokens: int, **extra) -> dict:
    """A /v1/completions body with an exact prompt of ``n_input`` token ids."""
    return {"model": MODEL, "prompt": [100 + (i % 500) for i in range(n_input)],
            "max_tokens": max_tokens, **extra}


def bearer(secret: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **headers}


class QuotaStack(Stack):
    """A running server with handles into its parts, its clock and an HTTP client."""

    def __init__(self, runtime: ServeRuntime, base_url: str, clock: ManualClock,
                 client: httpx.AsyncClient) -> None:
        super().__init__(runtime, base_url)
        self.clock = clock
        self.client = client

    async def complete(self, secret: str, n_input: int = 10, max_tokens: int = 5, *,
                       headers: dict[str, str] | None = None, **extra) -> httpx.Response:
        return await self.client.post("/v1/completions", headers=bearer(secret, **(headers or {})),
                                      json=completion(n_input, max_tokens, **extra))

    def billed(self, **where: str) -> list[dict]:
        """Billed usage rows in the ledger matching column = value filters: the rows of each
        logical request that bill it (bill classes ``usage`` and ``undelivered_billed``)."""
        cond = " AND ".join(f"{k} = {{{k}:String}}" for k in where) or "1"
        return self.rows(f"SELECT * FROM {classified_usage_sql(cond)} WHERE bill_class IN {BILLED_CLASSES} "
                         "ORDER BY finish_ts", **where)

    def usage_rows(self, **where: str) -> list[dict]:
        """Every usage row (one per attempt that reached admission) matching the filters, with its
        bill class, in finish order."""
        cond = " AND ".join(f"{k} = {{{k}:String}}" for k in where) or "1"
        return self.rows(f"SELECT * FROM {classified_usage_sql(cond)} ORDER BY finish_ts", **where)

    def attempts(self, **where: str) -> list[dict]:
        cond = " AND ".join(f"{k} = {{{k}:String}}" for k in where) or "1"
        return self.rows(f"SELECT * FROM attempts FINAL WHERE {cond} ORDER BY ts, attempt", **where)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> HFTokenizer:
    """The model's real tokenizer (loaded once)."""
    return HFTokenizer(model_dir)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_wall=T0_WALL)


@pytest.fixture
async def serve(tmp_path: Path, tokenizer: HFTokenizer, clock: ManualClock
                ) -> AsyncIterator[Callable[..., Awaitable[QuotaStack]]]:
    """``await serve(tenants_yaml, engine=None, quota_store="memory://", scheduler_options={},
    bus=None, routing=None, models=None, prices_yaml=PRICES_YAML)`` starts one stack for the test
    (stopped, ledger closed, at teardown); a given engine publishes its stats on the bus it was
    built with, so pass that bus too. ``models``: ``engine.models`` entries (``engine.kind:
    remote``), whose engine pools the runtime builds, starts and shuts down itself."""
    started: list[tuple[uvicorn.Server, asyncio.Task, httpx.AsyncClient, Engine | None]] = []

    async def start(tenants_yaml: str, *, engine: Engine | None = None, quota_store: str = "memory://",
                    scheduler_options: dict | None = None, max_model_len: int = 4096,
                    bus: StatsBus | None = None, routing: str | None = None, models: list[dict] | None = None,
                    prices_yaml: str = PRICES_YAML) -> QuotaStack:
        assert not started, "one stack per test (chDB: one path per process)"
        (tmp_path / "tenants.yaml").write_text(tenants_yaml)
        (tmp_path / "prices.yaml").write_text(prices_yaml)
        port = free_port()
        config = load_serve_config(None, {
            ("server", "port"): port, ("engine", "kind"): "instant",
            ("tenants",): str(tmp_path / "tenants.yaml"), ("prices",): str(tmp_path / "prices.yaml"),
            ("quota_store",): quota_store, ("scheduler", "options"): scheduler_options or {},
            ("ledger_dsn",): f"chdb://{tmp_path}/chdb", ("spool_dir",): str(tmp_path / "spool"),
            ("engine", "routing"): routing,
            **({("engine", "kind"): "remote", ("engine", "models"): models,
                ("engine", "remote_metrics_url"): "off"} if models else {}),
        }, env={})
        if not models:
            engine = engine or InstantEngine(tokenizer, MODEL, max_model_len=max_model_len)
            await engine.start()  # a given engine is not started by the runtime
        runtime = ServeRuntime(config, engine=engine, registry=CollectorRegistry(), clock=clock, bus=bus)
        server = uvicorn.Server(uvicorn.Config(runtime.app(), host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="on"))
        task = await start_uvicorn(server)
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60)
        started.append((server, task, client, engine))
        return QuotaStack(runtime, f"http://127.0.0.1:{port}", clock, client)

    yield start
    for server, task, client, engine in started:
        await client.aclose()
        server.should_exit = True
        await task
        if engine is not None:
            await engine.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this folder's async tests on the session event loop (where the fixtures live)."""
    run_async_tests_on_session_loop(Path(__file__).parent, items)


@pytest.fixture(params=["memory", "redis"])
def quota_store(request: pytest.FixtureRequest) -> str:
    """The quota store URL: the same test body on the in-memory store and on a real Redis (a
    fresh database number per test keeps the counters of earlier tests out)."""
    if request.param == "memory":
        return "memory://"
    url = request.getfixturevalue("redis_url")
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()
    return url


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a state of the running server to be reached (an event this test cannot await
    directly, e.g. a request parked in another task); fails after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
