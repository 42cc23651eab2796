"""Engines for the HTTP quota tests: the ``instant`` engine held at a gate, or failing.

The gateway's quota paths that depend on a request being *in flight* (parallel branches of an
agent run, concurrent idempotent retries joining a running attempt, a client leaving while queued)
need an engine that does not answer before the test says so; engine-error paths need one that
fails. Both are the real :class:`~kvmeter.serving.engines.instant.InstantEngine` (real tokenizer,
exact token accounting) with one behaviour added — the rest of the stack is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from kvmeter.serving.engines.base import EngineError, EngineOutput, EngineRequest
from kvmeter.serving.engines.instant import InstantEngine

__all__ = ["GatedEngine", "FailingEngine"]


class GatedEngine(InstantEngine):
    """Each request waits for :attr:`gate` before it answers; :attr:`in_flight` counts waiters."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.in_flight = 0
        self._changed = asyncio.Condition()

    async def wait_in_flight(self, n: int, timeout_s: float = 30.0) -> None:
        """Return once ``n`` requests are waiting at the gate (an event, not a delay)."""
        async def until() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.in_flight == n)
        await asyncio.wait_for(until(), timeout_s)

    async def _bump(self, delta: int) -> None:
        async with self._changed:
            self.in_flight += delta
            self._changed.notify_all()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        await self._bump(1)
        try:
            await self.gate.wait()
        finally:
            await self._bump(-1)
        async for out in super().generate(request):
            yield out


class FailingEngine(InstantEngine):
    """Every request fails with a retryable :class:`EngineError` before any output."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.requests_total += 1
        raise EngineError("instant engine told to fail", retryable=True)
        yield  # pragma: no cover — makes this an async generator
