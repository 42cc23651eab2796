"""The engine's own account of each finished request, on its way to whoever bills it.

An in-process engine reports one :class:`~kvmeter.stats.EngineRequestStats` per finished engine
request (vLLM: one per sequence, so a request with ``n`` choices reports ``n``, all under the id it
was given). :class:`FinishedStats` holds them for the caller that *claimed* the id before starting
the request — the OpenAI layer's metered engine client, which merges a logical request's engine
requests into one engine record — and publishes every other report on the stats bus at once, as
the engine hooks always did.

A claim ends with :meth:`FinishedStats.take` (the claimer has the reports) or
:meth:`FinishedStats.release` (the request was aborted or failed: what arrived is published as it
is, and so is anything that arrives later).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable

from kvmeter.stats import EngineRequestStats

__all__ = ["FinishedStats"]

log = logging.getLogger(__name__)

#: Claimed ids kept at most (a claim never taken nor released is dropped oldest first).
MAX_CLAIMS = 10_000


class FinishedStats:
    """Per-request finished stats, handed to the claimer or published.

    Args:
        publish: where unclaimed (and released) reports go (the stats bus's ``publish``).
        max_claims: claims kept at most; the oldest is released beyond it.
    """

    def __init__(self, publish: Callable[[EngineRequestStats], None], *, max_claims: int = MAX_CLAIMS) -> None:
        self._publish = publish
        self._max = max_claims
        self._claims: OrderedDict[str, list[EngineRequestStats]] = OrderedDict()
        self._waiters: dict[str, asyncio.Event] = {}

    def claim(self, request_id: str) -> None:
        """Hold the reports of ``request_id`` for :meth:`take` (call before the engine starts it)."""
        self._claims.setdefault(request_id, [])
        while len(self._claims) > self._max:
            oldest = next(iter(self._claims))
            log.warning("finished stats of %s never taken; published as reported", oldest)
            self.release(oldest)

    def put(self, stats: EngineRequestStats) -> None:
        """One report from the engine (its hooks): held for a claimer, else published."""
        held = self._claims.get(stats.request_id)
        if held is None:
            self._publish(stats)
            return
        held.append(stats)
        waiter = self._waiters.get(stats.request_id)
        if waiter is not None:
            waiter.set()

    async def take(self, request_id: str, count: int, timeout_s: float) -> list[EngineRequestStats]:
        """The reports of a claimed ``request_id`` once ``count`` of them arrived, or what arrived
        within ``timeout_s`` seconds (a warning then); ends the claim (later reports are
        published as they come)."""
        held = self._claims.get(request_id)
        if held is None:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while len(held) < count:
                left = deadline - loop.time()
                if left <= 0:
                    log.warning("the engine reported %d of %d finished stats for %s; using the frontend's "
                                "counts", len(held), count, request_id)
                    break
                waiter = self._waiters[request_id] = asyncio.Event()
                try:
                    await asyncio.wait_for(waiter.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._waiters.pop(request_id, None)
            self._claims.pop(request_id, None)
        return held

    def release(self, request_id: str) -> None:
        """End the claim without taking: publish what arrived (and, from now on, what arrives)."""
        held = self._claims.pop(request_id, None)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.set()
        for stats in held or ():
            self._publish(stats)
