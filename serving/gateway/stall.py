"""A stream's sends to its client, watched: the time they block, and the cut of a reader that stalls.

A server-sent-events answer is written by awaiting the ASGI ``send`` once per event. uvicorn's
``send`` returns at once while its transport's write buffer is under the high-water mark
(asyncio's default, 64 KiB) and otherwise waits until the client has read enough of it
(``FlowControl.drain``). While it waits, nothing pulls the stream's generator, so the send buffer a
stalled reader costs the gateway is bounded — the transport's buffer plus the one event being sent,
no more — but the request stays alive in the engine: on the in-process engines vLLM keeps decoding
it into its output collector and its KV stays allocated; on ``--engine remote`` the upstream's
response stays open. A reader that never resumes would pin that KV until the connection dies.

:class:`SendGuard` wraps ``send`` (:meth:`SendGuard.wrap`) and measures every send of the stream
on the injected clock; :meth:`SendGuard.watch`, run beside the response, cuts the stream (calls
``cut``) once one send has been blocked for ``stall_s`` seconds
(``GatewaySettings.stream_stall_timeout_s``). Its sleeps are injected too (``sleep``), so a test
drives it with a :class:`~kvmeter.clock.ManualClock` and no real waiting. The response
(:class:`~kvmeter.serving.gateway.handler.ClosingStreamingResponse`) then closes the stream's
generator exactly as after a client disconnect: the engine request is aborted (its KV freed) and
the attempt is recorded ``aborted`` with cause ``client_abandoned``, billed for the engine's work as
a disconnect is (one billing path; docs/ARCHITECTURE.md, "Metering rules").

Definitions (all seconds on the injected clock's ``monotonic()``):

* a send *blocked* when it took at least :data:`BLOCKED_AFTER_S`: uvicorn's ``send`` does not
  suspend unless its transport is paused, so a send that returned sooner was a plain write;
* ``send_blocked_s``: the sum of the blocked sends' durations; ``blocked_bytes``: the body bytes of
  those sends (SSE bytes that waited in the gateway for the client to read);
* ``blocked_kv_token_s``: Σ over blocked sends of the KV tokens the request held when the send
  began (``held_kv_tokens()``, the request meter's view) × the send's duration. A lower bound:
  while a send blocks the engine may keep generating, and the meter sees those tokens only later;
* ``duration_s``: the first send (the response's headers) → the end of the last send (or the cut).

The watchdog wakes every ``stall_s / 4`` while no send is blocked, so a stream is cut between
``stall_s`` and ``1.25 × stall_s`` after its send began blocking.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import anyio
from starlette.types import Message, Send

from kvmeter.attribution import Attribution
from kvmeter.clock import Clock
from kvmeter.stats import StreamSendStats

__all__ = ["SendGuard", "BLOCKED_AFTER_S"]

#: A send that took at least this long (seconds) waited for the client (see the module docstring).
BLOCKED_AFTER_S = 0.001


class SendGuard:
    """Measures one stream's sends and decides its stall cut.

    Args:
        clock: injected clock (``monotonic()`` for every duration).
        stall_s: cut the stream once one send has been blocked this long (seconds, > 0); ``None``:
            never cut (the sends are still measured).
        held_kv_tokens: the KV tokens the request holds now (tokens ≥ 0), read when a send begins.
        sleep: how :meth:`watch` waits (seconds); default ``anyio.sleep``.
    Raises:
        ValueError: ``stall_s`` ≤ 0.
    """

    __slots__ = ("_clock", "stall_s", "_held", "_sleep", "_since", "started_mono", "ended_mono", "sent_bytes",
                 "send_blocked_s", "blocked_bytes", "blocked_kv_token_s", "longest_block_s", "stalled")

    def __init__(self, clock: Clock, stall_s: float | None, *, held_kv_tokens: Callable[[], int] = lambda: 0,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall_s must be > 0 (or None), got {stall_s}")
        self._clock = clock
        self.stall_s = stall_s
        self._held = held_kv_tokens
        self._sleep = sleep
        self._since: float | None = None  # when the send in progress began
        self.started_mono: float | None = None
        self.ended_mono: float | None = None
        self.sent_bytes = 0
        self.send_blocked_s = 0.0
        self.blocked_bytes = 0
        self.blocked_kv_token_s = 0.0
        self.longest_block_s = 0.0
        #: the watchdog cut the stream (a send blocked for ``stall_s``)
        self.stalled = False

    def wrap(self, send: Send) -> Send:
        """``send``, measured (see the module docstring)."""
        clock = self._clock

        async def guarded(message: Message) -> None:
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            began = clock.monotonic()
            if self.started_mono is None:
                self.started_mono = began
            held = self._held()
            self._since = began
            try:
                await send(message)
                self.sent_bytes += len(body)
            finally:
                self._since = None
                ended = self.ended_mono = clock.monotonic()
                took = ended - began
                if took >= BLOCKED_AFTER_S:
                    self.send_blocked_s += took
                    self.blocked_bytes += len(body)
                    self.blocked_kv_token_s += held * took
                    self.longest_block_s = max(self.longest_block_s, took)

        return guarded

    async def watch(self, cut: Callable[[], None]) -> None:
        """Until cancelled: call ``cut`` (once, then return) when a send has been blocked for
        ``stall_s`` seconds. Returns at once when ``stall_s`` is None."""
        stall = self.stall_s
        if stall is None:
            return
        while True:
            since = self._since
            now = self._clock.monotonic()
            if since is not None and now - since >= stall:
                self.stalled = True
                cut()
                return
            await self._sleep(stall / 4 if since is None else since + stall - now)

    def stats(self, attribution: Attribution, wall_ts: float) -> StreamSendStats:
        """What the stream's sends came to, for the bus (call it once the stream has ended)."""
        start = self.started_mono
        end = self.ended_mono if self.ended_mono is not None else start
        duration = max(0.0, end - start) if start is not None and end is not None else 0.0
        return StreamSendStats(
            attribution=attribution, duration_s=duration, sent_bytes=self.sent_bytes,
            send_blocked_s=self.send_blocked_s, blocked_bytes=self.blocked_bytes,
            blocked_kv_token_s=self.blocked_kv_token_s, longest_block_s=self.longest_block_s,
            stall_cut=self.stalled, wall_ts=wall_ts)
