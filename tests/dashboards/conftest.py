"""Fixtures for the dashboard tests: a ledger filled by a real replay, read back three ways.

Phases (one session):

1. :func:`replay` — the real stack (``ServeRuntime`` + the session's vLLM CPU engine + uvicorn on
   loopback, as tests/serving/gateway/conftest.py) serves a short workload from four demo tenants into a
   fresh chDB ledger; the serve process's own signal recorder samples engine, scheduler, request
   and GPU signals (GPU readings from the real H200 capture through the capture-backed NVML)
   every second. Then the stack stops (the ledger closes).
2. :func:`reader` — ``kvmeter serve`` again on the same ledger (the instant engine: nothing to
   generate, only its read API is used) in a background thread, with the dashboard routes mounted
   as the lead will mount them; mode *a* tests read through it over loopback.
3. :func:`dsn_ledger` — the reader stopped; mode *b* tests open the chDB path directly.

chDB allows one embedded engine per process, so phases 2 and 3 take turns: each fixture stops
the other's holder first (``ReplayData.reader_stop``), and either may come back later.
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone
from typing import Iterator

import pytest
import uvicorn
from dashkit import H200_CAPTURE, ReaderServer, ReplayData, close_dashboard_backend, workload
from prometheus_client import CollectorRegistry

from kvmeter.serving.config import load_serve_config
from tests.conftest import free_port, start_uvicorn


@pytest.fixture(scope="package")  # chDB holds one path per process: release it with the package
async def replay(vllm_engine, tmp_path_factory):
    """Run the workload through the real gateway and engine into a fresh chDB ledger (≈ 30 s).
    At the end of the session, stops the reader serve if one is running."""
    from kvmeter.collectors.gpu import CaptureNvml
    from kvmeter.serving.runtime import ServeRuntime

    root = tmp_path_factory.mktemp("dash-replay")
    saved = {k: os.environ.get(k) for k in ("KVMETER_SIGNALS_INTERVAL_S", "KVMETER_GPU_POLL_INTERVAL_S")}
    os.environ["KVMETER_SIGNALS_INTERVAL_S"] = "1"
    os.environ["KVMETER_GPU_POLL_INTERVAL_S"] = "1"
    try:
        port = free_port()
        # overload control off: on a loaded machine it would (rightly) shed the free tenant's burst
        # and refuse late requests, and the pages' expected rows would depend on the machine's load;
        # the refusals this workload makes on purpose are the quota's (hobbyist's concurrency limit)
        config = load_serve_config(None, {("server", "port"): port, ("ledger_dsn",): f"chdb://{root}/chdb",
                                          ("spool_dir",): str(root / "spool"),
                                          ("scheduler", "options"): {"overload_control": False}}, env={})
        runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=vllm_engine, bus=vllm_engine.test_bus,
                               nvml=CaptureNvml.from_file(H200_CAPTURE))
        server = uvicorn.Server(uvicorn.Config(runtime.app(), host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on"))
        task = await start_uvicorn(server)
        data = ReplayData(root=root, start=datetime.now(timezone.utc), end=datetime.now(timezone.utc),
                          model=runtime.engine.model_name)
        await workload(f"http://127.0.0.1:{port}", data.model, data)
        await asyncio.sleep(2.5)  # two more signal samples after the last request
        # the rollups (hourly usage, agent runs) as the writer's next minutely refresh would leave them
        assert runtime.recorder.ledger.flush(60)
        await asyncio.to_thread(runtime.recorder.ledger.refresh_rollups)
        data.end = datetime.now(timezone.utc)
        server.should_exit = True
        await task  # lifespan stop: last signal sample, spool drained, ledger closed
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield data
    data.reader_stop()


@pytest.fixture
def reader(replay: ReplayData) -> Iterator[ReaderServer]:
    """The replay's ledger served by ``kvmeter serve`` with the dashboard routes (mode *a*)."""
    yield replay.reader_start()


@pytest.fixture
def dsn_ledger(replay: ReplayData) -> Iterator[str]:
    """The replay's chDB DSN with no serve process holding it (mode *b*)."""
    replay.reader_stop()
    yield replay.dsn
    close_dashboard_backend()  # release the dashboards' chDB client for the next holder


@pytest.fixture
def dashboard_env(monkeypatch, replay: ReplayData):
    """Set the dashboard's environment for one AppTest run; caches are reset before and after."""
    from kvmeter.dashboards.config import ENV

    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    close_dashboard_backend()

    def configure(*, key: str, server: str | None = None, dsn: str | None = None, range_: str = "last 15 min") -> None:
        close_dashboard_backend()  # the backend is process-wide (st.cache_resource): rebuild it
        if server:
            monkeypatch.setenv("KVMETER_DASHBOARD_SERVER", server)
        if dsn:
            monkeypatch.setenv("KVMETER_LEDGER_DSN", dsn)
        monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", key)
        monkeypatch.setenv("KVMETER_DASHBOARD_UNTIL", replay.until)
        monkeypatch.setenv("KVMETER_DASHBOARD_RANGE", range_)
        monkeypatch.setenv("KVMETER_DASHBOARD_REFRESH_S", "0")

    yield configure
    close_dashboard_backend()
