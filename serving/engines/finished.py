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

A claim names the request's :class:`~kvmeter.attribution.Attribution`: vLLM's hooks see only
request ids, so every report of a claimed id — taken, published after a release (an abort's
account arrives with the engine's next step) or kept for :meth:`account` — is stamped with it here
before anyone sees it. A report of an id nobody claimed keeps the attribution it came with
(:data:`~kvmeter.attribution.UNATTRIBUTED` from the hooks).

Every report is also kept (the last :data:`MAX_ACCOUNTS`) for :meth:`FinishedStats.account`: a
consumer that closed a request early awaits the engine's account of the work it did, which the
engine gives with its next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from kvmeter.attribution import Attribution
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts

__all__ = ["FinishedStats", "merge_stats"]

log = logging.getLogger(__name__)

#: Claimed ids kept at most (a claim never taken nor released is dropped oldest first).
MAX_CLAIMS = 10_000
#: Reports kept for :meth:`FinishedStats.account` (oldest dropped first).
MAX_ACCOUNTS = 10_000


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
        self._recent: OrderedDict[str, EngineRequestStats] = OrderedDict()
        self._account_waiters: dict[str, list[asyncio.Future[EngineRequestStats]]] = {}
        # request id → attribution of claimed requests; outlives the claim (an abort's account
        # arrives after the release), bounded like the kept reports
        self._attributions: OrderedDict[str, Attribution] = OrderedDict()

    def claim(self, request_id: str, attribution: Attribution | None = None) -> None:
        """Hold the reports of ``request_id`` for :meth:`take` (call before the engine starts it);
        stamp ``attribution`` (if given) on every report of it."""
        self._claims.setdefault(request_id, [])
        if attribution is not None:
            self._attributions[request_id] = attribution
            self._attributions.move_to_end(request_id)
            while len(self._attributions) > MAX_ACCOUNTS:
                self._attributions.popitem(last=False)
        while len(self._claims) > self._max:
            oldest = next(iter(self._claims))
            log.warning("finished stats of %s never taken; published as reported", oldest)
            self.release(oldest)

    def attribution_of(self, request_id: str) -> Attribution | None:
        """The attribution ``request_id`` was claimed with, or ``None`` (never claimed, or pushed
        out by :data:`MAX_ACCOUNTS` newer claims)."""
        return self._attributions.get(request_id)

    def put(self, stats: EngineRequestStats) -> None:
        """One report from the engine (its hooks): held for a claimer, else published; kept for
        :meth:`account` either way; stamped with the claim's attribution."""
        attribution = self._attributions.get(stats.request_id)
        if attribution is not None:
            stats.attribution = attribution
        self._recent[stats.request_id] = stats
        self._recent.move_to_end(stats.request_id)
        while len(self._recent) > MAX_ACCOUNTS:
            self._recent.popitem(last=False)
        for future in self._account_waiters.pop(stats.request_id, ()):
            if not future.done():
                future.set_result(stats)
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
            if len(held) >= count:  # every report is in: nothing more to stamp
                self._attributions.pop(request_id, None)
        return held

    def release(self, request_id: str) -> None:
        """End the claim without taking: publish what arrived (and, from now on, what arrives)."""
        held = self._claims.pop(request_id, None)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.set()
        for stats in held or ():
            self._publish(stats)

    def recent(self, request_id: str) -> EngineRequestStats | None:
        """The last report of ``request_id`` kept, if any (no waiting)."""
        return self._recent.get(request_id)

    async def account(self, request_id: str, timeout_s: float) -> EngineRequestStats | None:
        """The last report of ``request_id``, waiting up to ``timeout_s`` seconds (≥ 0) for one to
        arrive; ``None`` if none did."""
        stats = self._recent.get(request_id)
        if stats is not None or timeout_s <= 0:
            return stats
        future: asyncio.Future[EngineRequestStats] = asyncio.get_running_loop().create_future()
        self._account_waiters.setdefault(request_id, []).append(future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return self._recent.get(request_id)
        finally:
            waiters = self._account_waiters.get(request_id)
            if waiters is not None and future in waiters:
                waiters.remove(future)
                if not waiters:
                    del self._account_waiters[request_id]

def merge_stats(request_id: str, per_engine: Sequence[Sequence[EngineRequestStats]]) -> EngineRequestStats:
    """One engine record for a logical request from its engine requests' finished stats.

    ``per_engine``: for each engine request (one per prompt), the stats of its sequences (``n``
    choices: ``n`` records, each counting the same prompt). The input counts once per engine
    request (the largest of its sequences' counts; they are equal) and so do its cached input
    tokens (the smallest: never more than every sequence got from the prefix cache); output tokens
    and preemptions add up over every sequence; times are the longest; the finish reason and the
    attribution are the first sequence's of the first engine request (the caller stamps the
    logical request's attribution on the result when its engine requests carried none).

    Raises:
        ValueError: ``per_engine`` or one of its items is empty.
    """
    if not per_engine or not all(per_engine):
        raise ValueError("merge_stats needs at least one record per engine request")
    first = per_engine[0][0]
    if len(per_engine) == 1 and len(per_engine[0]) == 1 and first.request_id == request_id:
        return first
    every = [s for group in per_engine for s in group]
    generated = sum(s.tokens.output_tokens for s in every)
    tpots = [(s.mean_tpot_s, s.tokens.output_tokens) for s in every if s.tokens.output_tokens > 1]
    weight = sum(n - 1 for _, n in tpots)
    return EngineRequestStats(
        request_id=request_id, finish_reason=first.finish_reason,
        tokens=TokenCounts(
            input_tokens=sum(max(s.tokens.input_tokens for s in group) for group in per_engine),
            cached_input_tokens=sum(min(s.tokens.cached_input_tokens for s in group) for group in per_engine),
            output_tokens=generated),
        queued_s=max(s.queued_s for s in every), prefill_s=max(s.prefill_s for s in every),
        decode_s=max(s.decode_s for s in every), inference_s=max(s.inference_s for s in every),
        e2e_s=max(s.e2e_s for s in every),
        mean_tpot_s=sum(t * (n - 1) for t, n in tpots) / weight if weight else 0.0,
        preemptions=sum(s.preemptions for s in every), wall_ts=max(s.wall_ts for s in every),
        computed_tokens=_sum_known(s.computed_tokens for s in every),
        preempted_tokens=_sum_known(s.preempted_tokens for s in every),
        phase_times_measured=all(s.phase_times_measured for s in every),
        attribution=first.attribution)


def _sum_known(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any value is unknown."""
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total
