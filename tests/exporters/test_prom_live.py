"""A real Prometheus (Debian package) scrapes kvmeter's /metrics over loopback, evaluates the
shipped rule files unmodified, and alerts fire — checked through Prometheus' HTTP API.

Two targets: a tiny uvicorn app serving the exporter's registry, fed by bus events (an XID fires
the critical GPU alert, which has no ``for``); and a running ``kvmeter serve`` (its own process:
real uvicorn, ServeRuntime, the instant engine, an embedded ledger) under a retry storm, whose
rule goes pending (its ``for: 5m`` is the product's setting; the pending → firing step is covered
by the promtool unit tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.routing import Route

from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus, metrics_asgi_app, rule_files
from kvmeter.serving.tenancy import hash_api_key
from kvmeter.stats import EngineStepStats, GpuSample, XidEvent

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not on PATH (Debian: apt-get install -y prometheus)"),
]


def wait_for(what: str, check, timeout_s: float = 60.0):
    """Poll an external process until ``check()`` returns a truthy value (not timing logic)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


@pytest.fixture
def exporter_target(bus, registry, clock, free_port):
    """uvicorn serving ``GET /metrics`` from a fresh registry fed by ``bus``; yields host:port."""
    install_prometheus(bus, registry, clock=clock, config=PrometheusConfig(model="m"))
    app = Starlette(routes=[Route("/metrics", endpoint=metrics_asgi_app(registry))])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the exporter app", lambda: server.started, 30)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def prometheus_server(tmp_path, free_port):
    """Start a real Prometheus on loopback scraping ``target`` every second; yields a query helper."""
    procs = []

    def start(target: str, rules: list[Path]):
        port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rules],
            "scrape_configs": [{"job_name": "kvmeter", "static_configs": [{"targets": [target]}]}],
        }
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

        def ready():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                return api.get("/-/ready").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("Prometheus to be ready", ready)
        return api

    yield start
    for proc, log in procs:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def query(api: httpx.Client, promql: str) -> list[dict]:
    body = api.get("/api/v1/query", params={"query": promql}).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def alerts(api: httpx.Client) -> dict[str, str]:
    body = api.get("/api/v1/alerts").json()
    return {a["labels"]["alertname"]: a["state"] for a in body["data"]["alerts"]}


def alert_labels(api: httpx.Client, name: str) -> list[dict[str, str]]:
    return [a["labels"] for a in api.get("/api/v1/alerts").json()["data"]["alerts"]
            if a["labels"]["alertname"] == name]


def test_prometheus_scrapes_and_an_alert_fires(bus, exporter_target, prometheus_server):
    by_name = {p.name: p for p in rule_files()}
    files = [by_name["gpu.yml"], by_name["engine.yml"]]
    api = prometheus_server(exporter_target, files)
    # every group of both files loaded (engine.yml has the per-tenant step-share rules as a second group)
    declared = {g["name"] for f in files for g in yaml.safe_load(f.read_text())["groups"]}
    assert {"kvmeter-gpu", "kvmeter-engine", "kvmeter-engine-tenant-shares"} <= declared
    assert {g["name"] for g in api.get("/api/v1/rules").json()["data"]["groups"]} == declared

    bus.publish(EngineStepStats(wall_ts=1.0, kv_watermark_ratio=0.96, kv_blocks_total=1000, num_running=40))
    bus.publish(GpuSample(wall_ts=1.0, index=0, name="NVIDIA H200", temperature_gpu_celsius=52.0))
    bus.publish(XidEvent(wall_ts=1.0, gpu_index=0, xid=79))

    # the scraped values are the published ones
    kv = wait_for("the KV watermark to be scraped",
                  lambda: query(api, 'kvmeter_engine_kv_watermark_ratio{job="kvmeter"}'))
    assert float(kv[0]["value"][1]) == 0.96 and kv[0]["metric"]["engine"] == "0"
    wait_for("the first XID to be scraped", lambda: query(api, "kvmeter_gpu_xid_errors_total == 1"))

    # a second XID after Prometheus has seen the first: increase() > 0 → the critical alert fires
    bus.publish(XidEvent(wall_ts=2.0, gpu_index=0, xid=79))
    wait_for("KvmeterGpuXidCritical to fire", lambda: alerts(api).get("KvmeterGpuXidCritical") == "firing")
    # the KV rule (for: 5m) is evaluated on the same live data and is pending
    assert alerts(api).get("KvmeterKvWatermarkHigh") == "pending"
    assert "KvmeterGpuXidError" not in alerts(api)  # XID 79 is in the critical list only


AGENT_KEY = "sk-live-agent-0001"
TENANTS_YAML = textwrap.dedent(f"""\
    version: 1
    default_tier: free
    orgs:
      agent-co:
        tier: enterprise
        workspaces:
          default:
            projects:
              loop:
                api_keys:
                  agent-key:
                    key_sha256: {hash_api_key(AGENT_KEY)}
    """)


@pytest.fixture
def kvmeter_serve(tmp_path, free_port):
    """``kvmeter serve --engine instant`` in its own process on loopback; yields its base URL."""
    port = free_port()
    (tmp_path / "tenants.yaml").write_text(TENANTS_YAML)
    log = open(tmp_path / "serve.log", "w")
    cmd = [sys.executable, "-m", "kvmeter.cli", "serve", "--engine", "instant", "--port", str(port),
           "--tenants", str(tmp_path / "tenants.yaml"), "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}",
           "--spool-dir", str(tmp_path / "spool")]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("kvmeter serve to be ready", healthy, 120)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        finally:
            log.close()
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit status -15)
    log_text = (tmp_path / "serve.log").read_text()
    assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log_text, log_text


def test_retry_storm_on_a_running_kvmeter_serve(kvmeter_serve, prometheus_server):
    by_name = {p.name: p for p in rule_files()}
    api = prometheus_server(kvmeter_serve.removeprefix("http://"),
                            [by_name["requests.yml"], by_name["tenants.yml"]])
    client = httpx.Client(base_url=kvmeter_serve, timeout=30,
                          headers={"authorization": f"Bearer {AGENT_KEY}", "idempotency-key": "run-7-step-3"})
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [100 + i for i in range(64)], "max_tokens": 16}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text

    # an agent loop re-sending the same step (same Idempotency-Key), ~10 times a second: every
    # retry is answered from the stored result — no engine work, no second bill
    def storm():
        for _ in range(10):
            again = client.post("/v1/completions", json=body)
            assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
            time.sleep(0.1)  # paces the load generator (not timing logic)
        return alerts(api).get("KvmeterRetryStorm") == "pending"

    wait_for("KvmeterRetryStorm to go pending", storm, 90)
    assert alert_labels(api, "KvmeterRetryStorm") == [
        {"alertname": "KvmeterRetryStorm", "severity": "warning", "tier": "enterprise"}]
    replays = query(api, 'kvmeter_gateway_idempotent_replays_total{tier="enterprise"}')
    retries = query(api, 'kvmeter_gateway_retries_total{tier="enterprise",tenant="agent-co"}')
    assert float(replays[0]["value"][1]) >= 10 and float(retries[0]["value"][1]) >= 10
    admitted = query(api, 'sum(kvmeter_admission_admitted_requests_total{tier="enterprise"})')
    assert float(admitted[0]["value"][1]) == 1  # only the first attempt was admitted
    # the scheduler and ledger sources are wired into serve and scraped
    assert query(api, "kvmeter_scheduler_jain_index_ratio") and query(api, "kvmeter_ledger_spool_depth_events")
    assert query(api, "kvmeter_gpu_nvml_available")
    client.close()
