"""The instant engine reports its work like a real engine: each finished request's
``EngineRequestStats`` on the stats bus, so ``kvmeter billing reconcile`` over a ledger that
``kvmeter serve --engine instant`` wrote matches every request (no ledger-only drift, exit 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import polars as pl
import pytest

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.model import DEFAULT_MODEL_NAME
from kvmeter.serving.engines.base import EngineRequest
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.serving.demo import wait_ready
from kvmeter.serving.engines.instant import InstantEngine
from kvmeter.stats import EngineRequestStats
from tests.conftest import free_port

KEYS = {"acme": "sk-demo-acme-0001", "globex": "sk-demo-globex-0001"}  # the demo tenants' public keys


async def test_each_request_is_published_on_the_bus_before_its_finish_reaches_the_caller(model_dir):
    bus, clock = StatsBus(), ManualClock(start_wall=1_795_000_000.0)
    seen: list[EngineRequestStats] = []
    bus.subscribe(EngineRequestStats, seen.append)
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, bus=bus, clock=clock)
    await engine.start()
    prompt = engine.tokenizer.encode("How many tokens is this prompt?")
    outputs = []
    attribution = Attribution("acme", tier="free", model=DEFAULT_MODEL_NAME)
    async for out in engine.generate(EngineRequest(request_id="req-1", prompt_token_ids=prompt, max_tokens=7,
                                                   attribution=attribution)):
        assert [s.request_id for s in seen] == ["req-1"], "published before the finish is yielded"
        outputs.append(out)
    (out,) = outputs
    (stats,) = seen
    assert out.finished and out.stats is stats
    assert stats.attribution is attribution  # stamped by the engine: the ledger needs no side map
    assert (stats.tokens.input_tokens, stats.tokens.output_tokens, stats.finish_reason) == (len(prompt), 7, "length")
    assert stats.wall_ts == 1_795_000_000.0  # the injected clock's wall time, not the system's
    await engine.shutdown()


def _serve(tmp_path: Path, port: int) -> subprocess.Popen:
    """``kvmeter serve --engine instant`` (the demo tenants) on its own chDB ledger in ``tmp_path``."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "serve.log", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "kvmeter.cli", "serve", "--engine", "instant",
                                 "--port", str(port), "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}",
                                 "--spool-dir", str(tmp_path / "spool")],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def _traffic(base: str) -> dict[str, int]:
    """A few requests of each kind; returns the admitted (engine-run) requests per tenant."""
    served = {"acme": 0, "globex": 0}
    with httpx.Client(base_url=base, timeout=60) as client:
        def post(tenant: str, path: str, body: dict, **headers: str) -> httpx.Response:
            return client.post(path, json={"model": DEFAULT_MODEL_NAME, **body},
                               headers={"authorization": f"Bearer {KEYS[tenant]}", **headers})

        for i in range(3):
            r = post("acme", "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 5 + i})
            assert r.status_code == 200, r.text
            served["acme"] += 1
        r = post("globex", "/v1/completions", {"prompt": "stream me a few tokens", "max_tokens": 9, "stream": True,
                                               "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        served["globex"] += 1
        body = {"prompt": [11, 12, 13], "max_tokens": 4}
        first = post("globex", "/v1/completions", body, **{"idempotency-key": "k1"})
        again = post("globex", "/v1/completions", body, **{"idempotency-key": "k1"})
        assert first.status_code == again.status_code == 200 and first.json()["id"] == again.json()["id"]
        served["globex"] += 1  # the replay is served from the stored result: no engine work
        r = post("acme", "/v1/completions", {"prompt": "x", "max_tokens": 0})
        assert r.status_code == 400, r.text  # refused before the engine: an attempt, no usage
    return served


@pytest.mark.slow
def test_reconcile_over_an_instant_engine_ledger_finds_no_drift(tmp_path: Path):
    port = free_port()
    base, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    start = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=1)
    proc = _serve(tmp_path, port)
    try:
        wait_ready(proc, base, log, timeout_s=180)
        served = _traffic(base)
        proc.send_signal(signal.SIGINT)  # graceful: the spool drains into chDB, the ledger closes
        assert proc.wait(120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(minutes=1)
    period = f"{start.isoformat().replace('+00:00', 'Z')}/{end.isoformat().replace('+00:00', 'Z')}"
    rows = _reconcile(tmp_path, period)
    assert set(rows) == set(served), rows
    for tenant, n in served.items():
        row = rows[tenant]
        assert row["status"] == "ok", row
        assert row["engine_requests"] == row["ledger_requests"] == row["matched_requests"] == n, row
        assert row["engine_tokens"] == row["ledger_tokens"] > 0, row
        assert row["ledger_only_requests"] == row["engine_unbilled_requests"] == row["mismatched_requests"] == 0, row
        assert row["unexplained_drift_tokens"] == 0 and row["frontend_only_requests"] == 0, row
    assert rows["globex"]["replayed_attempts"] == 1 and rows["acme"]["gateway_attempts"] == 4, rows
    # one tenant: its engine records are found by the tenant the ledger stored with them (from the
    # request's admitted attempt), so they must have been published after that attempt was recorded
    (row,) = _reconcile(tmp_path, period, "--tenant", "globex").values()
    assert row["tenant_id"] == "globex" and row["status"] == "ok", row
    assert row["engine_requests"] == row["matched_requests"] == served["globex"] and row["ledger_only_requests"] == 0


def _reconcile(tmp_path: Path, period: str, *flags: str) -> dict[str, dict]:
    """``kvmeter billing reconcile`` over the stopped server's ledger: asserts exit 0 and a clean
    summary; returns the CSV's rows by tenant."""
    out = tmp_path / ("out" + "-".join(flags))
    run = subprocess.run([sys.executable, "-m", "kvmeter.cli", "billing", "reconcile", "--period", period,
                          "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}", "--spool-dir", str(tmp_path / "spool"),
                          "--out", str(out), "--formats", "csv", *flags],
                         capture_output=True, text=True, timeout=300, env={**os.environ}, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    tenants = 1 if flags else 2
    assert run.stderr.strip().splitlines()[-1] == f"{tenants} tenant(s): no unexplained drift above 0", run.stderr
    (csv,) = out.glob("reconcile-*.csv")
    return {r["tenant_id"]: r for r in pl.read_csv(csv).iter_rows(named=True)}
