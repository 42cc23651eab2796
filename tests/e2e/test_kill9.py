"""kill -9 of ``kvmeter serve`` during traffic: after a restart, exactly one billable record per
logical request, with the engine's token counts.

A real ``kvmeter serve`` (vLLM CPU engine, embedded chDB ledger) takes concurrent requests that
carry an ``Idempotency-Key``; the process is SIGKILLed while some are still streaming. It is started
again on the same ledger and spool; the client retries every request that did not complete (same
key, same body). After a graceful stop, the ledger (opened directly) must hold one record per key,
whose tokens equal the usage the server reported for the completed attempt.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvmeter.serving.demo import wait_ready
from tests.conftest import free_port

pytestmark = [pytest.mark.engine, pytest.mark.slow]

KEY = "sk-demo-globex-0001"


def _start(port: int, root: Path, log_name: str) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(root / log_name, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "kvmeter.cli", "serve", "--port", str(port), "--max-model-len", "2048",
         "--kv-cache-gib", "1", "--ledger-dsn", f"chdb://{root}/chdb", "--spool-dir", str(root / "spool")],
        stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)  # its own process group: the kill takes vLLM's engine processes too


async def _send(client: httpx.AsyncClient, i: int, model: str) -> dict | None:
    """One logical request; returns its usage if the response completed, else None."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
            "max_tokens": 48, "min_tokens": 48, "temperature": 0.0, "stream": i % 2 == 0}
    if body["stream"]:  # vLLM refuses stream_options on a request that does not stream
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {KEY}", "idempotency-key": f"kill9-{i}"}
    try:
        if not body["stream"]:
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            return resp.json()["usage"] if resp.status_code == 200 else None
        usage, done = None, False
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return None
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
        return usage if done else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def _traffic(url: str, model: str, ids: list[int], proc: subprocess.Popen | None = None,
                   kill_after: int = 0) -> dict[int, dict | None]:
    results: dict[int, dict | None] = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=5)) as client:
        tasks = {asyncio.create_task(_send(client, i, model)): i for i in ids}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                results[tasks[t]] = t.result()
            if proc is not None and len(results) >= kill_after and proc.poll() is None:
                # mid-traffic, the rest still in flight; the whole group, as a node or container
                # kill would (vLLM's EngineCore/Worker do not watch their parent: a kill of serve
                # alone leaves them running and holding gigabytes)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def test_kill_dash_nine_then_restart_bills_each_logical_request_once(tmp_path: Path):
    from kvmeter.ledger.config import LedgerConfig
    from kvmeter.ledger.connection import connect
    from kvmeter.model import DEFAULT_MODEL_NAME

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ids = list(range(24))
    proc = _start(port, tmp_path, "serve-1.log")
    wait_ready(proc, url, tmp_path / "serve-1.log")
    first = asyncio.run(_traffic(url, DEFAULT_MODEL_NAME, ids, proc, kill_after=8))
    assert proc.returncode == -signal.SIGKILL
    completed = {i: u for i, u in first.items() if u is not None}
    unfinished = [i for i in ids if first.get(i) is None]
    assert completed and unfinished, "the kill should land mid-traffic"

    proc = _start(port, tmp_path, "serve-2.log")  # same ledger, same spool: recovery drains it
    wait_ready(proc, url, tmp_path / "serve-2.log")
    retried = asyncio.run(_traffic(url, DEFAULT_MODEL_NAME, unfinished))
    proc.send_signal(signal.SIGINT)  # graceful: drain everything
    assert proc.wait(120) in (0, -signal.SIGINT)  # uvicorn re-raises SIGINT after a graceful stop

    usage = {**completed, **retried}
    assert all(usage[i] is not None for i in ids), "every retry should complete"
    # chDB holds one data path per process: a client left open here makes every later in-process
    # ledger at another path fail with LedgerLocked, so it is closed before the assertions
    client = connect(LedgerConfig(dsn=f"chdb://{tmp_path}/chdb"))
    try:
        rows = client.query(
            "SELECT idempotency_key, count() AS n, any(input_tokens) AS p, any(output_tokens) AS c, "
            "any(outcome) AS o FROM usage_events FINAL WHERE tenant_id = 'globex' GROUP BY idempotency_key"
        ).result_rows
    finally:
        client.close()
    billed = {key: (n, p, c, o) for key, n, p, c, o in rows}
    for i in ids:
        n, p, c, o = billed[f"kill9-{i}"]
        assert n == 1, f"kill9-{i} billed {n} times"
        assert (p, c, o) == (usage[i]["prompt_tokens"], usage[i]["completion_tokens"], "ok"), f"kill9-{i}"
    assert len(billed) == len(ids)
