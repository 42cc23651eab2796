"""Remote vLLM /metrics: parsing of the real expositions, V0/V1 names, several engines, histograms,
and counter resets told apart from garbage — over a real loopback HTTP server."""

from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.collectors.remote_vllm import (
    RemoteVllmScraper,
    ScrapeError,
    parse_vllm_metrics,
)
from kvmeter.stats import HistogramSnapshot, RemoteEngineStats

V0 = "vllm_metrics/vllm_v0_metrics_qwen2.5-coder-1.5b_aibrix_docs.prom"
V1 = "vllm_metrics/vllm_v1_qwen2.5-coder-32b_prodstack318.prom"
QWEN_15 = ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "0")


# ------------------------------------------------------------------ the real expositions

def test_v0_exposition(data_dir):
    page = parse_vllm_metrics((data_dir / V0).read_text())
    assert list(page.engines) == [QWEN_15]  # cache_config_info (no model_name) merged, not an engine
    eng = page.engines[QWEN_15]
    assert eng.gauges == {"num_running": 0.0, "num_swapped": 0.0, "num_waiting": 0.0,
                          "kv_cache_usage": 0.0, "prefix_cache_hit_rate": -1.0}
    assert eng.sources["kv_cache_usage"] == "vllm:gpu_cache_usage_perc"
    assert page.deprecated_names == {"vllm:gpu_cache_usage_perc"}
    assert {k: v.value for k, v in eng.counters.items()} == {
        "preemptions": 0.0, "input_tokens": 148.0, "output_tokens": 955.0, "request_success:stop": 4.0}
    assert (eng.kv_blocks_total, eng.kv_block_size_tokens) == (81767, 16)
    hist = eng.histograms["iteration_tokens"]
    # the doc excerpt ends mid-histogram: sum known, count unknown → no quantile is invented
    assert hist.sum == 1103.0 and hist.count is None and hist.buckets[0] == (1.0, 994.0)
    assert hist.quantile(0.5) is None


def test_v0_first_scrape_stats(data_dir):
    (st,) = RemoteVllmScraper("http://v0/metrics", clock=ManualClock()).ingest((data_dir / V0).read_text())
    assert st.kv_cache_usage_ratio == 0.0 and st.kv_blocks_total == 81767
    assert st.prefix_cache_hit_rate is None  # -1 means the prefix cache is disabled
    assert st.deltas == {} and st.interval_s is None  # nothing to diff against yet


def test_v1_exposition_with_deprecated_kv_name(data_dir):
    page = parse_vllm_metrics((data_dir / V1).read_text())
    assert page.process_start_time == pytest.approx(1.74262400557e9)
    (key,) = page.engines
    assert key == ("Qwen/Qwen2.5-Coder-32B-Instruct", "0")
    assert page.engines[key].gauges == {"num_running": 0.0, "num_waiting": 0.0, "kv_cache_usage": 0.0}
    assert "vllm:gpu_cache_usage_perc" in page.deprecated_names


@pytest.mark.parametrize("order", ["new_first", "old_first"])
def test_current_name_wins_over_deprecated_alias(data_dir, order):
    new = ('# TYPE vllm:kv_cache_usage_perc gauge\n'
           'vllm:kv_cache_usage_perc{model_name="Qwen/Qwen2.5-Coder-32B-Instruct",engine="0"} 0.42\n')
    text = (data_dir / V1).read_text()
    page = parse_vllm_metrics(new + text if order == "new_first" else text + new)
    eng = page.engines[("Qwen/Qwen2.5-Coder-32B-Instruct", "0")]
    assert eng.gauges["kv_cache_usage"] == 0.42 and eng.sources["kv_cache_usage"] == "vllm:kv_cache_usage_perc"


@pytest.mark.parametrize("garbage", [
    'vllm:num_requests_running{model_name="x" 3\n',
    "\x00\x01binary\xff",
    "vllm:num_requests_running{} not-a-number\n",
])
def test_garbage_is_a_scrape_error(garbage):
    with pytest.raises(ScrapeError, match="not a Prometheus"):
        parse_vllm_metrics(garbage)


# ------------------------------------------------------------------ pages built by prometheus-client

TTFT_BUCKETS = (0.1, 0.5, 1.0, 5.0)


def v1_page(engines: dict[str, dict], *, start_time: float | None = None,
            created: float | None = None) -> str:
    """A V1-style /metrics page written by prometheus-client itself (as vLLM does), for several
    engines. ``created`` rewrites every ``_created`` value (a counter re-created at that time)."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=reg)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg)
    gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg)
    pre = Counter("vllm:num_preemptions", "preemptions", labels, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=TTFT_BUCKETS, registry=reg)
    for engine, v in engines.items():
        lv = ("m", engine)
        kv.labels(*lv).set(v.get("kv", 0.0))
        waiting.labels(*lv).set(v.get("waiting", 0))
        prompt.labels(*lv).inc(v.get("prompt", 0))
        gen.labels(*lv).inc(v.get("gen", 0))
        pre.labels(*lv).inc(v.get("preempt", 0))
        for x in v.get("ttfts", ()):
            ttft.labels(*lv).observe(x)
    text = generate_latest(reg).decode()
    if created is not None:
        text = re.sub(r"(_created\{[^}]*\}) \S+", lambda m: f"{m.group(1)} {created!r}", text)
    if start_time is not None:
        text = ("# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {start_time!r}\n") + text
    return text


def test_several_engines_and_created_never_summed():
    page = parse_vllm_metrics(v1_page({"0": {"prompt": 100, "kv": 0.3}, "1": {"prompt": 250, "kv": 0.9}},
                                      created=1.7e9))
    assert set(page.engines) == {("m", "0"), ("m", "1")}
    totals = sum(e.counters["input_tokens"].value for e in page.engines.values())
    assert totals == 350.0  # the _created samples (1.7e9 each) are not values
    assert page.engines[("m", "1")].counters["input_tokens"].created == 1.7e9
    assert page.engines[("m", "1")].gauges["kv_cache_usage"] == 0.9


def test_histogram_buckets_and_quantiles():
    ttfts = [0.05] * 10 + [0.3] * 10  # 20 requests: half under 0.1 s, half in (0.1, 0.5]
    eng = parse_vllm_metrics(v1_page({"0": {"ttfts": ttfts}})).engines[("m", "0")]
    h = eng.histograms["ttft"]
    assert h.count == 20 and h.sum == pytest.approx(3.5)
    assert h.buckets == [(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (5.0, 20.0), (math.inf, 20.0)]
    # Prometheus histogram_quantile: linear inside the bucket holding the rank
    assert h.quantile(0.5) == pytest.approx(0.1)                      # rank 10 → top of (0, 0.1]
    assert h.quantile(0.9) == pytest.approx(0.1 + 0.4 * (18 - 10) / 10)  # rank 18 in (0.1, 0.5]
    assert h.quantile(0.25) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        h.quantile(1.5)
    over = HistogramSnapshot([(1.0, 1.0), (math.inf, 4.0)], 20.0, 4.0)
    assert over.quantile(0.99) == 1.0  # rank in +Inf → the largest finite bound
    assert HistogramSnapshot([(1.0, 0.0), (math.inf, 0.0)], 0.0, 0.0).quantile(0.5) is None


# ------------------------------------------------------------------ a real loopback HTTP server

class _Pages:
    def __init__(self) -> None:
        self.body = ""
        self.status = 200


@pytest.fixture
def metrics_server():
    pages = _Pages()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            body = pages.body.encode()
            self.send_response(pages.status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", pages
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_rates_and_garbage_over_http(data_dir, metrics_server):
    url, pages = metrics_server
    clock = ManualClock()
    bus = StatsBus()
    published: list[RemoteEngineStats] = []
    bus.subscribe(RemoteEngineStats, published.append)
    scraper = RemoteVllmScraper(url, clock=clock, bus=bus)
    real = (data_dir / V0).read_text()
    pages.body = real
    (first,) = scraper.scrape()
    assert first.deltas == {} and first.source == url and first.engine_id == f"{url}#0"

    # a changed page, derived from the real one: 300 more prompt and 1000 more output tokens
    pages.body = (real.replace("prompt_tokens_total{model_name=\"Qwen/Qwen2.5-Coder-1.5B-Instruct\"} 148.0",
                               "prompt_tokens_total{model_name=\"Qwen/Qwen2.5-Coder-1.5B-Instruct\"} 448.0")
                      .replace("} 955.0", "} 1955.0"))
    clock.advance(10.0)
    (second,) = scraper.scrape()
    assert second.interval_s == 10.0
    assert second.deltas == {"input_tokens": 300.0, "output_tokens": 1000.0, "preemptions": 0.0,
                             "request_success:stop": 0.0}
    assert second.rates_per_s["output_tokens"] == pytest.approx(100.0)
    assert second.anomalies == []

    # garbage: the counter drops with no newer _created and no restart → invalid, not counted
    pages.body = real.replace("} 955.0", "} 17.0").replace("} 148.0", "} 448.0")
    clock.advance(10.0)
    (third,) = scraper.scrape()
    assert "output_tokens" not in third.deltas
    [anomaly] = third.anomalies
    assert (anomaly.kind, anomaly.previous, anomaly.current) == ("invalid", 1955.0, 17.0)
    assert anomaly.series.startswith("output_tokens{")

    # the baseline stayed at 1955: the next good value is diffed against it, not against 17
    pages.body = real.replace("} 955.0", "} 2055.0").replace("} 148.0", "} 448.0")
    clock.advance(10.0)
    (fourth,) = scraper.scrape()
    assert fourth.deltas["output_tokens"] == 100.0 and fourth.anomalies == []
    assert len(published) == 4
    scraper.close()


def test_reset_by_process_restart(metrics_server):
    url, pages = metrics_server
    clock = ManualClock()
    scraper = RemoteVllmScraper(url, clock=clock)
    # same _created on both pages: the restart alone must be enough evidence
    pages.body = v1_page({"0": {"prompt": 5000, "gen": 9000}}, start_time=1.7e9, created=1.7e9)
    scraper.scrape()
    pages.body = v1_page({"0": {"prompt": 40, "gen": 70}}, start_time=1.7e9 + 600, created=1.7e9)
    clock.advance(15.0)
    (st,) = scraper.scrape()
    assert st.deltas["input_tokens"] == 40 and st.deltas["output_tokens"] == 70  # counted from 0
    assert st.deltas["preemptions"] == 0
    assert {a.kind for a in st.anomalies} == {"reset"}
    assert "process restarted" in st.anomalies[0].reason


def test_reset_by_newer_created_and_histogram_windows(metrics_server):
    url, pages = metrics_server
    clock = ManualClock()
    scraper = RemoteVllmScraper(url, clock=clock)
    pages.body = v1_page({"0": {"prompt": 900, "ttfts": [0.05] * 4}, "1": {"prompt": 10}}, created=1.7e9)
    scraper.scrape()
    # engine 0 grows normally; its histogram gets 10 slow first tokens in this window
    pages.body = v1_page({"0": {"prompt": 1000, "ttfts": [0.05] * 4 + [3.0] * 10}, "1": {"prompt": 30}},
                         created=1.7e9)
    clock.advance(10.0)
    by_engine = {s.engine: s for s in scraper.scrape()}
    assert by_engine["0"].deltas["input_tokens"] == 100 and by_engine["1"].deltas["input_tokens"] == 20
    window = by_engine["0"].windows["ttft"]
    assert window.count == 10 and window.sum == pytest.approx(30.0)
    assert by_engine["0"].quantiles["ttft"][0.5] == pytest.approx(1.0 + 4.0 * 5 / 10)  # in (1, 5]
    # every counter re-created later with a small value: resets, counted from 0
    pages.body = v1_page({"0": {"prompt": 7, "ttfts": [0.05, 0.05]}, "1": {"prompt": 3}}, created=1.7e9 + 300)
    clock.advance(10.0)
    by_engine = {s.engine: s for s in scraper.scrape()}
    assert by_engine["0"].deltas["input_tokens"] == 7 and by_engine["1"].deltas["input_tokens"] == 3
    resets = [a for a in by_engine["0"].anomalies if a.series.startswith("input_tokens")]
    assert resets[0].kind == "reset" and resets[0].reason == "newer _created"
    assert by_engine["0"].windows["ttft"].count == 2  # histogram reset too: window = since re-creation


def test_out_of_range_gauges_are_missing(metrics_server):
    url, pages = metrics_server
    pages.body = v1_page({"0": {"kv": 1.7, "waiting": -3}})
    (st,) = RemoteVllmScraper(url, clock=ManualClock()).scrape()
    assert st.kv_cache_usage_ratio is None and st.num_waiting is None


def test_http_failures_are_scrape_errors(metrics_server):
    url, pages = metrics_server
    scraper = RemoteVllmScraper(url, clock=ManualClock(), timeout_s=2.0)
    pages.status, pages.body = 500, "oops"
    with pytest.raises(ScrapeError, match="HTTP 500"):
        scraper.scrape()
    pages.status, pages.body = 200, "vllm:num_requests_running{oops 1\n"
    with pytest.raises(ScrapeError, match="not a Prometheus"):
        scraper.scrape()
    dead = RemoteVllmScraper("http://127.0.0.1:9/metrics", clock=ManualClock(), timeout_s=2.0)
    with pytest.raises(ScrapeError, match="cannot scrape"):
        dead.scrape()


def test_nan_counter_is_invalid_and_keeps_the_baseline():
    scraper = RemoteVllmScraper("http://x/metrics", clock=ManualClock())
    good = v1_page({"0": {"prompt": 100}}, created=1.7e9)
    scraper.ingest(good)
    (bad,) = scraper.ingest(good.replace('vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
                                         'vllm:prompt_tokens_total{engine="0",model_name="m"} NaN'))
    assert "input_tokens" not in bad.deltas
    assert [(a.kind, a.reason) for a in bad.anomalies] == [("invalid", "not a finite, non-negative number")]
    (after,) = scraper.ingest(v1_page({"0": {"prompt": 130}}, created=1.7e9))
    assert after.deltas["input_tokens"] == 30
