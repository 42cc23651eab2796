"""Helpers of the dashboard tests (imported as ``dashkit``; the fixtures live in conftest.py):
the replay workload and its record, the reader serve, and resetting the dashboards' caches."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.serving.config import load_serve_config
from kvmeter.traces import data_file
from tests.conftest import free_port

KEYS = {
    "acme": "sk-demo-acme-0001",          # enterprise
    "globex": "sk-demo-globex-0001",      # paid_interactive
    "umbrella": "sk-demo-umbrella-0001",  # paid_interactive, the noisy neighbour (long prompts)
    "hobbyist": "sk-demo-hobbyist-0001",  # free: 2 concurrent requests, 20 per minute
    "admin": "sk-demo-admin-0001",
}
TENANTS = ("acme", "globex", "hobbyist", "umbrella")
H200_CAPTURE = data_file("gpu/nvidia_smi/linux-x86_64__nvidia-h200__590.48.01.txt")
APP = Path(__file__).resolve().parents[2] / "dashboards" / "app.py"


@dataclass
class ReplayData:
    """What the replay did, as the client saw it, and where the ledger is.

    Attributes:
        root: the run directory (``chdb/``, ``spool/``).
        start, end: wall-clock span of the replay (UTC).
        ok: per tenant, completed requests' usage as the client received it
            (``requests``, ``input_tokens``, ``output_tokens``).
        aborted: per tenant, streams the client dropped after the first chunk.
        rejected: per tenant, requests answered 429 (quota limits, or shed by the scheduler — a
            deadline that passed in the queue behind the noisy neighbour is a real outcome here).
    """

    root: Path
    start: datetime
    end: datetime
    model: str
    ok: dict[str, dict[str, int]] = field(default_factory=dict)
    aborted: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    _reader: Any = None

    @property
    def dsn(self) -> str:
        return f"chdb://{self.root / 'chdb'}"

    @property
    def until(self) -> str:
        """The dashboards' pinned window end: a minute after the replay."""
        return (self.end + timedelta(minutes=1)).isoformat()

    def billed_requests(self, tenant: str) -> int:
        """Requests that must have a usage event: completed plus aborted (billed for the work done)."""
        return self.ok.get(tenant, {}).get("requests", 0) + self.aborted.get(tenant, 0)

    def reader_start(self) -> "ReaderServer":
        """The replay's ledger served by ``kvmeter serve`` (mode *a*): the running reader, or a new
        one (a mode-b test's chDB client is closed first: serve must open the path)."""
        if self._reader is None or self._reader not in ACTIVE_READERS:
            close_dashboard_backend()
            self._reader = ReaderServer(self)
        return self._reader

    def reader_stop(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            if reader in ACTIVE_READERS:
                reader.stop()


def _prompt(words: int, seed: int) -> list[dict[str, str]]:
    vocab = ["token", "memory", "queue", "tenant", "prefill", "decode", "cache", "budget", "fair", "batch"]
    text = " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(words))
    return [{"role": "user", "content": f"Request {seed}: {text}"}]


async def workload(base_url: str, model: str, data: ReplayData) -> None:
    """acme and globex: short chats; umbrella: long prompts (the noisy neighbour); hobbyist: a
    burst over its 2-request concurrency limit (429s); two globex streams dropped mid-way; then
    acme's agent runs (:func:`agent_runs`)."""

    async def complete(tenant: str, words: int, out: int, seed: int, delay: float, run: str = "") -> None:
        await asyncio.sleep(delay)
        body = {"model": model, "messages": _prompt(words, seed), "max_tokens": out, "min_tokens": out,
                "temperature": 0.0}
        headers = {"authorization": f"Bearer {KEYS[tenant]}", **({"x-agent-run-id": run} if run else {})}
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        if r.status_code == 200:
            usage = r.json()["usage"]
            acc = data.ok.setdefault(tenant, {"requests": 0, "input_tokens": 0, "output_tokens": 0})
            acc["requests"] += 1
            acc["input_tokens"] += usage["prompt_tokens"]
            acc["output_tokens"] += usage["completion_tokens"]
        elif r.status_code == 429:
            data.rejected[tenant] = data.rejected.get(tenant, 0) + 1
        else:
            raise AssertionError(f"{tenant}: unexpected {r.status_code} {r.text[:200]}")

    async def abandon(tenant: str, seed: int, delay: float) -> None:
        await asyncio.sleep(delay)
        body = {"model": model, "messages": _prompt(40, seed), "max_tokens": 200, "min_tokens": 200,
                "temperature": 0.0, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEYS[tenant]}"}) as r:
            if r.status_code == 429:  # shed: e.g. its deadline passed while the noisy neighbour ran
                data.rejected[tenant] = data.rejected.get(tenant, 0) + 1
                return
            if r.status_code != 200:
                raise AssertionError(f"{tenant} stream: {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # the client goes away after the first token
        data.aborted[tenant] = data.aborted.get(tenant, 0) + 1

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        jobs = []
        for i in range(10):
            jobs.append(complete("acme", 30 + 5 * i, 24, i, 0.3 * i))
            jobs.append(complete("globex", 40 + 3 * i, 32, 100 + i, 0.3 * i + 0.1))
        for i in range(5):
            jobs.append(complete("umbrella", 1200 + 50 * i, 48, 200 + i, 0.8 * i))
        for i in range(8):
            jobs.append(complete("hobbyist", 20, 16, 300 + i, 1.0))
        jobs += [abandon("globex", 400, 0.5), abandon("globex", 401, 2.0)]
        await asyncio.gather(*jobs)
        await agent_runs(client, complete)


async def agent_runs(client: httpx.AsyncClient, complete: Any) -> None:
    """acme's agents (the demo tenants give acme a tool policy): a research run with model calls,
    permitted, blocked and high-risk (pending approval) tool calls, and a run stopped as a loop
    (more than 5 identical read-only calls). Model calls go through ``complete`` (counted as the
    others); tool calls answer 200 / 403 / 202 / 409."""
    headers = {"authorization": f"Bearer {KEYS['acme']}"}

    async def tool(run: str, body: dict[str, Any]) -> int:
        return (await client.post(f"/v1/agent_runs/{run}/tool_calls", headers=headers, json=body)).status_code

    for i in range(2):
        await complete("acme", 30, 16, 500 + i, 0.0, run="dash-research")
    assert await tool("dash-research", {"tool": "search_docs", "arguments": {"q": "kv cache"}}) == 200
    assert await tool("dash-research", {"tool": "send_report", "arguments": {"to": "ops"}}) == 200
    assert await tool("dash-research", {"tool": "shell_exec", "arguments": {"cmd": "ls"}}) == 403
    assert await tool("dash-research", {"tool": "deploy_index", "arguments": {"v": 2}}) == 202
    codes = [await tool("dash-loop", {"tool": "search_web", "arguments": {"q": "same"}}) for _ in range(6)]
    assert codes == [200] * 5 + [409], codes


#: Reader serves running now (at most one: chDB holds one engine per process).
ACTIVE_READERS: list["ReaderServer"] = []


def stop_readers() -> None:
    """Stop every running reader serve (before a test opens another chDB path in-process)."""
    while ACTIVE_READERS:
        ACTIVE_READERS[-1].stop()


class ReaderServer:
    """``kvmeter serve`` (instant engine) on the replay's ledger in a thread, with the dashboard
    routes mounted — the read API the dashboards use in mode *a*."""

    def __init__(self, data: ReplayData) -> None:
        from kvmeter.dashboards.routes import serve_routes
        from kvmeter.serving.runtime import ServeRuntime

        self.port = free_port()
        config = load_serve_config(None, {("server", "port"): self.port, ("ledger_dsn",): data.dsn,
                                          ("spool_dir",): str(data.root / "spool"), ("engine", "kind"): "instant"},
                                   env={})
        self.runtime = ServeRuntime(config, registry=CollectorRegistry())
        self.dash = serve_routes(self.runtime)
        app = self.runtime.app()
        app.router.routes.extend(self.dash.routes)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="dash-reader", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "reader serve did not start"
            time.sleep(0.05)
        ACTIVE_READERS.append(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self in ACTIVE_READERS:
            ACTIVE_READERS.remove(self)
        self.dash.close()  # before the ledger closes: its client shares the chDB engine
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "reader serve did not stop"


def close_dashboard_backend() -> None:
    import streamlit as st

    from kvmeter.dashboards import ui

    try:
        ui.backend().close()
    except Exception:  # noqa: BLE001 — a backend that could not even be built holds nothing
        pass
    ui.backend.clear()
    st.cache_data.clear()


