"""Sending a replay plan to a running gateway over HTTP, at the plan's arrival times.

Open loop: each request is sent at its planned time whether or not earlier ones finished (as real
traffic arrives), streamed with ``stream_options.include_usage``, and held to its trace output
length with ``min_tokens = max_tokens`` (vLLM's extension). The client measures what a user sees:
status, time to first token, end-to-end time, and the usage the server reported.

Arrival pacing uses the event loop's clock (this is a load generator, not timing logic under
test); a line of progress is printed as requests complete.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from kvmeter.serving.replay.plan import ReplayRequest

__all__ = ["ReplayResult", "replay"]


@dataclass(slots=True)
class ReplayResult:
    """What the client saw for one request (times in seconds; None when not reached)."""

    index: int
    tenant: str
    status: int
    input_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str = ""
    code: str = ""  # the error's ``code`` (kvmeter's refusal reason, e.g. ``deadline``, ``shed``)


async def _one(client: httpx.AsyncClient, model: str, req: ReplayRequest,
               messages: list[dict[str, str]]) -> ReplayResult:
    body = {"model": model, "messages": messages, "max_tokens": req.output_tokens,
            "min_tokens": req.output_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"authorization": f"Bearer {req.tenant.api_key}"}
    result = ReplayResult(index=req.index, tenant=req.tenant.name, status=0)
    t0 = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    err = json.loads(raw)["error"]
                    result.error = err["message"]
                    result.code = str(err.get("code") or "")
                except (ValueError, KeyError, TypeError):
                    result.error = raw[:200].decode("utf-8", "replace")
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    continue
                if chunk.get("usage"):
                    result.input_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif result.ttft_s is None and chunk.get("choices"):
                    delta = chunk["choices"][0].get("delta", {})
                    if delta.get("content"):
                        result.ttft_s = time.monotonic() - t0
    except httpx.HTTPError as exc:  # name the URL: "[Errno 111] Connection refused" alone says not where
        url = str(client.base_url).rstrip("/") + "/v1/chat/completions"
        result.error = f"{type(exc).__name__}: {exc or 'no detail'} (POST {url})"
    result.e2e_s = time.monotonic() - t0
    return result


async def replay(base_url: str, model: str, plan: list[ReplayRequest],
                 messages_for: Callable[[ReplayRequest], list[dict[str, str]]], *,
                 timeout_s: float = 600.0, progress_every_s: float = 5.0,
                 print_fn: Callable[[str], None] = print) -> list[ReplayResult]:
    """Replay ``plan`` against ``base_url``; returns one result per request, in plan order.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8000``.
        model: the served model name.
        plan: requests with arrival offsets (seconds from start).
        messages_for: builds each request's chat (prompt synthesis happens up front).
        timeout_s: per-request timeout.
        progress_every_s: seconds between progress lines.
    """
    bodies = [messages_for(r) for r in plan]  # synthesize before the clock starts
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=64)
    done = 0
    failed = 0
    start = time.monotonic()

    async def reporter() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            print_fn(f"  replay: {done}/{len(plan)} done, {failed} rejected/failed, "
                     f"{time.monotonic() - start:.0f}s elapsed")

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        async def fire(req: ReplayRequest, messages: list[dict[str, str]]) -> ReplayResult:
            nonlocal done, failed
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            res = await _one(client, model, req, messages)
            done += 1
            failed += res.status != 200 or bool(res.error)
            return res

        progress = asyncio.create_task(reporter())
        try:
            results = await asyncio.gather(*(fire(r, m) for r, m in zip(plan, bodies, strict=True)))
        finally:
            progress.cancel()
    print_fn(f"  replay: {done}/{len(plan)} done, {failed} rejected/failed, "
             f"{time.monotonic() - start:.0f}s total")
    return list(results)
