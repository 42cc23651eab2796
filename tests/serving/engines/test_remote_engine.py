"""The remote engine owns the scraper of its upstream's ``/metrics``: it publishes what it scrapes
and the upstream's KV load on the bus, tells a non-vLLM upstream apart, and stops gating on a
watermark it can no longer read. The upstream is a real OpenAI-compatible server on loopback
(uvicorn) whose ``/metrics`` is a real vLLM exposition (the captures in the data folder), with the
KV usage the test sets; time is a ManualClock."""

from __future__ import annotations

import asyncio
import logging
import re

import orjson
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.model import DEFAULT_MODEL_NAME
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.remote import STALE_INTERVALS, RemoteEngine, upstream_load
from kvmeter.serving.runtime import build_engine
from kvmeter.stats import EngineLoad, RemoteEngineStats
from kvmeter.traces import data_dir
from tests.conftest import free_port, start_uvicorn

MODEL = DEFAULT_MODEL_NAME
V0 = "vllm_metrics/vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom"  # has cache_config_info
V1 = "vllm_metrics/vllm_v1_qwen2.5-coder-32b_prodstack318.prom"  # has none
V0_BLOCKS, V0_BLOCK_SIZE = 81767, 16  # its vllm:cache_config_info


def vllm_page(capture: str, *, kv: float, running: int = 0, waiting: int = 0) -> str:
    """A real vLLM exposition with its model renamed to the served one and the KV usage and
    request gauges set (the captures were taken on idle servers)."""
    text = (data_dir() / capture).read_text()
    text = re.sub(r'model_name="[^"]*"', f'model_name="{MODEL}"', text)
    text = re.sub(r"^(vllm:gpu_cache_usage_perc\{[^}]*\}) \S+$", rf"\g<1> {kv!r}", text, flags=re.M)
    text = re.sub(r"^(vllm:num_requests_running\{[^}]*\}) \S+$", rf"\g<1> {running}.0", text, flags=re.M)
    return re.sub(r"^(vllm:num_requests_waiting\{[^}]*\}) \S+$", rf"\g<1> {waiting}.0", text, flags=re.M)


class Upstream:
    """A real OpenAI-compatible server on loopback whose ``/metrics`` answers ``self.page`` (or
    ``self.status`` when that is not 200)."""

    def __init__(self, page: str) -> None:
        self.page, self.status, self.scrapes = page, 200, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}),
                            media_type="application/json")

        async def metrics(request: Request) -> Response:
            self.scrapes += 1
            if self.status != 200:
                return PlainTextResponse("unavailable", status_code=self.status)
            return PlainTextResponse(self.page, media_type="text/plain; version=0.0.4")

        self.app = Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics)])

    async def __aenter__(self) -> "Upstream":
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.task = await start_uvicorn(self.server)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.task


def recorder(bus: StatsBus) -> tuple[list[EngineLoad], list[RemoteEngineStats]]:
    loads: list[EngineLoad] = []
    stats: list[RemoteEngineStats] = []
    bus.subscribe(EngineLoad, loads.append)
    bus.subscribe(RemoteEngineStats, stats.append)
    return loads, stats


async def test_the_engine_scrapes_its_upstream_and_publishes_its_kv_load(model_dir):
    bus, clock = StatsBus(), ManualClock(start_wall=1.8e9)
    loads, stats = recorder(bus)
    async with Upstream(vllm_page(V0, kv=0.42, running=3, waiting=1)) as up:
        engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, bus=bus, clock=clock,
                              scrape_interval_s=5.0)
        assert engine.metrics_url == f"{up.url}/metrics"  # derived from the remote URL
        await engine.start()
        try:
            capacity = V0_BLOCKS * V0_BLOCK_SIZE
            assert loads == [EngineLoad(0.42, capacity, 3, 1, per_step=False, model=MODEL)]  # known before any request
            assert engine.load() == loads[-1]
            assert [(s.source, s.model_name, s.kv_cache_usage_ratio) for s in stats] == \
                [(f"{up.url}/metrics", MODEL, 0.42)]
            up.page = vllm_page(V0, kv=0.93, running=9, waiting=4)
            assert await engine.scrape() == EngineLoad(0.93, capacity, 9, 4, per_step=False, model=MODEL)
            # the engine's own loop scrapes when one is due on the injected clock
            up.page = vllm_page(V0, kv=0.10)
            clock.advance(5.0)
            for _ in range(100):  # the loop wakes once a second of real time: wait for it
                if len(loads) == 3:
                    break
                await asyncio.sleep(0.05)
            assert loads[-1] == EngineLoad(0.10, capacity, 0, 0, per_step=False, model=MODEL)
        finally:
            await engine.shutdown()
        assert await engine.scrape() is None  # shut down: its scraper is closed


async def test_a_page_without_cache_config_gives_the_watermark_alone(model_dir):
    bus = StatsBus()
    loads, _ = recorder(bus)
    async with Upstream(vllm_page(V1, kv=0.97, running=12)) as up:
        engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, bus=bus, clock=ManualClock())
        await engine.start()
        await engine.shutdown()
    assert loads == [EngineLoad(0.97, 0, 12, 0, per_step=False, model=MODEL)]


def test_upstream_load_sums_the_served_models_engines():
    def st(model, engine, kv, blocks=1000, running=1.0):
        return RemoteEngineStats(source="u", model_name=model, engine=engine, wall_ts=0.0, kv_cache_usage_ratio=kv,
                                 kv_blocks_total=blocks, kv_block_size_tokens=16, num_running=running, num_waiting=2.0)
    load = upstream_load([st(MODEL, "0", 0.5), st(MODEL, "1", 0.9, blocks=3000), st("other", "0", 1.0)], MODEL)
    assert load == EngineLoad(pytest.approx((0.5 * 16_000 + 0.9 * 48_000) / 64_000), 64_000, 2, 4, per_step=False)
    assert upstream_load([st("served-as", "0", 0.3)], MODEL).kv_watermark_ratio == 0.3  # no label matches: all
    assert upstream_load([st(MODEL, "0", None)], MODEL) == EngineLoad(0.0, 0, 1, 2, per_step=False)
    assert upstream_load([], MODEL) is None


def not_vllm_page() -> str:
    reg = CollectorRegistry()
    Counter("http_requests", "requests served", registry=reg).inc(3)
    return generate_latest(reg).decode()


@pytest.mark.parametrize("case", ["404", "no vLLM series"])
async def test_an_upstream_that_is_not_vllm_is_logged_once_and_not_scraped(model_dir, caplog, case):
    bus, clock = StatsBus(), ManualClock()
    loads, stats = recorder(bus)
    async with Upstream(not_vllm_page()) as up:
        if case == "404":
            up.status = 404
        engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, bus=bus, clock=clock,
                              scrape_interval_s=1.0)
        with caplog.at_level(logging.WARNING, logger="kvmeter.serving.engines.remote"):
            await engine.start()
        try:
            assert not engine.scraping
            assert [r.getMessage() for r in caplog.records if "not scraped" in r.getMessage()], caplog.text
            clock.advance(10.0)
            assert await engine.scrape() is None
            assert up.scrapes == 1 and loads == [] and stats == []
            assert engine.load() == EngineLoad(model=MODEL)  # never reported: the scheduler gates on counts only
        finally:
            await engine.shutdown()


async def test_failing_scrapes_keep_the_load_then_report_it_unknown_until_the_upstream_answers(model_dir, caplog):
    bus, clock = StatsBus(), ManualClock()
    loads, _ = recorder(bus)
    async with Upstream(vllm_page(V0, kv=0.95)) as up:
        engine = RemoteEngine(up.url, model_dir=model_dir, model_name=MODEL, bus=bus, clock=clock,
                              scrape_interval_s=2.0)
        await engine.start()
        try:
            up.status = 503
            with caplog.at_level(logging.WARNING, logger="kvmeter.serving.engines.remote"):
                for _ in range(STALE_INTERVALS):
                    clock.advance(2.0)
                    assert await engine.scrape() is None
            warnings = [r for r in caplog.records if "cannot read the upstream's load" in r.getMessage()]
            assert len(warnings) == 1  # once per outage
            # the last reading stood for STALE_INTERVALS intervals, then the capacity is unknown
            assert [x.kv_watermark_ratio for x in loads] == [0.95, 0.0]
            assert loads[-1] == EngineLoad(0.0, 0, 0, 0, per_step=False, model=MODEL) == engine.load()
            up.status = 200
            up.page = vllm_page(V0, kv=0.2)
            clock.advance(2.0)
            assert (await engine.scrape()).kv_watermark_ratio == 0.2
            assert engine.scraping
        finally:
            await engine.shutdown()


async def test_serve_builds_the_remote_engine_with_its_scraper_on_the_bus(model_dir):
    bus, clock = StatsBus(), ManualClock()
    config = load_serve_config(None, {("engine", "kind"): "remote", ("engine", "remote_url"): "http://gpu-node:8000/",
                                      ("engine", "model"): str(model_dir),
                                      ("engine", "remote_scrape_interval_s"): 2.5}, env={})
    engine = build_engine(config, bus, clock)
    assert isinstance(engine, RemoteEngine)
    assert (engine.metrics_url, engine.scrape_interval_s, engine.scraping) == (
        "http://gpu-node:8000/metrics", 2.5, True)
    await engine.shutdown()
    off = load_serve_config(None, {("engine", "kind"): "remote", ("engine", "remote_url"): "http://gpu-node:8000",
                                   ("engine", "model"): str(model_dir), ("engine", "remote_metrics_url"): "off"},
                            env={})
    engine = build_engine(off, bus, clock)
    assert engine.metrics_url is None and not engine.scraping
    await engine.shutdown()
    own = load_serve_config(None, {("engine", "kind"): "remote", ("engine", "remote_url"): "http://gpu-node:8000",
                                   ("engine", "model"): str(model_dir),
                                   ("engine", "remote_metrics_url"): "http://gpu-node:9090/metrics"}, env={})
    engine = build_engine(own, bus, clock)
    assert engine.metrics_url == "http://gpu-node:9090/metrics"
    await engine.shutdown()
