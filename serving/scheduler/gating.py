"""Engine gating: when an engine replica may take one more request, and how many it may run.

kvmeter's ordering (VTC, tiers, shedding) only matters while requests wait in *its* queues; once
dispatched, a request is the engine's. So the gate decides how much of the backlog the engine
holds at once, per replica (:class:`EngineGate`):

* **KV watermark** — the engine's last reported KV use plus the prompts dispatched since, below
  ``kv_watermark_high`` of its capacity (vLLM preempts by recompute past full; a head-of-line
  request that does not fit waits rather than being skipped, see :mod:`.core`). The report is
  the engine's :class:`~kvmeter.stats.EngineLoad`: after every step for an engine kvmeter hosts,
  after every ``/metrics`` scrape for a remote vLLM server (a watermark without a known capacity
  closes the gate at ``kv_watermark_high`` alone);
* **engine waiting queue** — at most ``max_engine_waiting`` requests in the engine's own FCFS
  queue, so kvmeter, not the engine, decides the order (counted from per-step reports, or from
  kvmeter's own dispatched requests without a first token when the engine reports periodically);
* **running cap** — at most ``max_engine_running`` requests dispatched and not released;
* **adaptive limit** (:class:`AdaptiveEngineLimit`) — below that cap, a limit on the requests
  dispatched and not released, adjusted from the engine's observed step latencies so the running
  batch stays where the protected tiers' latency promises hold.

**The adaptive limit's control law** is additive-increase / multiplicative-decrease on a
concurrency window, as TCP congestion avoidance does (Jacobson, "Congestion Avoidance and
Control", SIGCOMM 1988; Chiu & Jain, "Analysis of the Increase and Decrease Algorithms for
Congestion Avoidance in Computer Networks", 1989, for AIMD's convergence), with *latency* rather
than loss as the congestion signal (as delay-based TCP Vegas does: Brakmo & Peterson, IEEE JSAC
1995) and its target taken from the SLOs. Every ``engine_limit_interval_s``:

* **signal** ``r = max(ITL̄ / ITL*, TTFT̃ / TTFT*)`` over the engine's step reports of the last
  ``engine_limit_window_s``: ``ITL̄`` the token-weighted mean inter-token latency (a request's TPOT
  is the mean of its ITLs over its life, so this is what the ITL objectives see, and one slow step
  weighs as little as it does in a TPOT), ``TTFT̃`` the median engine-side time to first token.
  Targets: ``ITL* = engine_itl_target_ratio × the tightest protected ITL SLO`` and
  ``TTFT* = engine_ttft_target_ratio × the tightest protected TTFT SLO`` among the tiers seen (a
  protected tier is never paused nor shed; the rest of the TTFT budget is kvmeter's queue's).
* **cut** when ``r > 1``: ``L ← max(L_min, β·L)`` (β = ``engine_limit_decrease``), then hold —
  no further decision until the engine's outstanding requests have shrunk to ``L`` (running
  requests keep their slots, so the latency reflects a smaller batch only once they finish: one
  reduction per round trip, as TCP does per RTT).
* **verify the cut**: a cut from well past the target (``r > 1 + (1 − β)``) is judged on the
  next ``JUDGE_INTERVALS`` intervals of the smaller batch; if ``r`` did not fall by at least half
  the cut's proportion — or the batch did not shrink to the new limit within
  ``_MAX_HOLD_INTERVALS`` (long requests hold the slots) — the latency is not the batch's doing
  (one long prefill slows every step, or the machine is slow), so the cut is undone, growth
  restarts with slow start, and no cut is made for ``2, 4, 8, …`` windows (backoff as TCP's
  retransmission timer; an effective cut resets it). Without this a latency the batch cannot fix
  would drive the limit to its floor and only cost throughput.
* **grow** when ``r ≤ 1`` and the limit held queued work back in the interval: ``L ← L + α``
  (α = ``engine_limit_increase``), or ``L ← 2L`` before the first effective cut (slow start);
  never above ``max_engine_running``. A limit that did not bind does not grow (RFC 7661's rule
  for an idle TCP window).
* **queue first, up to the SLO**: while the protected tiers' oldest queued request has used more
  of its queueing budget (``(1 − engine_ttft_target_ratio) × TTFT SLO``) than ``r`` says the
  latency overshoots, and the latency is still within the SLO itself (``r ≤ 1 /
  engine_itl_target_ratio``), the limit grows instead of being cut — the margin below the ITL
  SLO is spent on TTFT before requests miss their deadline, never more.
* no latency reports in the interval: no change; no protected tier seen (no targets): ``r = 0``,
  so a binding limit grows toward ``max_engine_running``.

**The first-token lead** (:meth:`EngineGate.first_token_lead_s`, what admission adds to a
request's projected queue wait and dispatch checks against its deadline) is the request's own:
``lead(P) = a + c × (U + P)``, ``P`` the request's prompt tokens, ``U`` the prompt tokens
dispatched to the replica that have no first token yet (the engine prefills them before or with
it), fitted by least squares over the replica's last :data:`LEAD_SAMPLES` first tokens — each
``(tokens it waited on: U at its dispatch + its prompt, dispatch → first token seconds)`` as the
core sees them (:meth:`~.core.SchedulerCore.charge_output`) — with ``a, c ≥ 0``; when the
samples' sizes do not vary (or the fit is negative) the lead is the mean latency scaled down in
proportion for smaller prompts and not extrapolated above the mean size. So one
long prefill (a 7.8k-token prompt, 26 s) raises the lead of long prompts, not of a short one on
an idle replica, and a tenant's heavy request does not get every other tenant refused
``projected_wait`` until a window of engine-wide TTFTs has passed (issue 17 item 3: an early
refusal falls on the tenant above its share). Before the replica's first such sample the lead is
the adaptive limit's engine-side TTFT median (``ttft_estimate_s``, 0.0 without one).

The limit starts at ``engine_limit_initial`` with the engine's first latency report; an engine
that never reports latencies (an engine without step stats) keeps only the static caps. The
inputs are the engine's own step reports (vLLM's ``IterationStats`` through the engine hooks on
the serving path, the simulated replica's step outcome in the simulator) through one method,
:meth:`~.core.SchedulerCore.observe_engine_latency`; nothing here knows which engine it is.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Iterable, Sequence

from kvmeter.serving.tenancy.tiers import TierPolicy
from kvmeter.stats import EngineLoad

from .config import SchedulerConfig

__all__ = ["EngineGate", "AdaptiveEngineLimit", "FirstTokenLead", "pick_engine", "open_engines", "free_kv",
           "most_free_kv", "latency_targets", "LEAD_SAMPLES"]

log = logging.getLogger(__name__)

#: First tokens a replica's lead model is fitted on (the most recent ones).
LEAD_SAMPLES = 64
#: Most TTFT samples kept per control interval (older ones are thinned).
_MAX_TTFT_SAMPLES = 4096
#: Intervals a cut waits for the batch to shrink to it; a cut that cannot take effect that fast
#: (long requests hold the slots) is undone rather than left to block dispatch.
_MAX_HOLD_INTERVALS = 4
#: Intervals of the smaller batch's latencies a cut is judged on.
JUDGE_INTERVALS = 3
#: Windows during which no cut is made after a cut that did not pay off (doubling with each
#: consecutive one, up to ``_MAX_NO_CUT_WINDOWS``; an effective cut resets it).
_NO_CUT_WINDOWS = 4
_MAX_NO_CUT_WINDOWS = 32


def latency_targets(tiers: Iterable[TierPolicy], config: SchedulerConfig) -> tuple[float | None, float | None]:
    """``(ITL*, TTFT*)`` in seconds from the tightest protected tier among ``tiers`` (None when
    no protected tier has that objective)."""
    tiers = list(tiers)
    itl = [t.itl_slo_s for t in tiers if t.protected and t.itl_slo_s is not None]
    ttft = [t.ttft_slo_s for t in tiers if t.protected and t.ttft_slo_s is not None]
    return (config.engine_itl_target_ratio * min(itl) if itl else None,
            config.engine_ttft_target_ratio * min(ttft) if ttft else None)


class AdaptiveEngineLimit:
    """AIMD limit on one engine's dispatched-and-unreleased requests (see the module docstring).

    Args:
        config: ``engine_limit_*`` settings and the ``max_engine_running`` ceiling.
        idx: the engine's index (log lines).
    Attributes:
        limit: the current limit (a float; the gate uses its floor), ``None`` until the engine's
            first latency report.
        decreases, increases: how many times it moved (stats, tests).
        last_ratio: the last interval's congestion signal ``r`` (0.0 before the first).
        ttft_estimate_s: the median engine-side TTFT over the last window with first tokens
            (0.0 before any): how long after dispatch a first token arrives, for deadlines.
    """

    __slots__ = ("_cfg", "_idx", "limit", "_slow_start", "_hold_until", "_next_eval", "_itl_sum", "_itl_n",
                 "_ttfts", "_past", "_check", "_judge_at", "_no_cut_until", "_no_cut_windows", "limited", "decreases",
                 "increases", "undone", "last_ratio", "ttft_estimate_s")

    def __init__(self, config: SchedulerConfig, idx: int = 0) -> None:
        self._cfg = config
        self._idx = idx
        self.limit: float | None = None
        self._slow_start = True
        self._hold_until: float | None = None  # set after a decrease: wait for the batch to shrink
        self._next_eval: float | None = None  # the first interval starts at the first update
        self._itl_sum = 0.0
        self._itl_n = 0
        self._ttfts: list[float] = []
        # earlier intervals of the sliding window: (itl_sum, itl_n, ttfts) each
        self._past: deque[tuple[float, int, list[float]]] = deque()
        self._check: tuple[float, float] | None = None  # (limit, signal) before the last cut
        self._judge_at = -math.inf  # when enough of the smaller batch's latencies have been seen
        self._no_cut_until = -math.inf
        self._no_cut_windows = _NO_CUT_WINDOWS
        self.limited = False
        self.decreases = 0
        self.increases = 0
        self.undone = 0
        self.last_ratio = 0.0
        self.ttft_estimate_s = 0.0

    def bound(self) -> int | None:
        """The limit as a request count (≥ 1), or None while inactive."""
        return None if self.limit is None else max(1, int(self.limit))

    def observe(self, itl_sum_s: float, itl_count: int, ttfts_s: Sequence[float]) -> None:
        """Add one step report: ``itl_count`` inter-token latencies summing to ``itl_sum_s``
        seconds, and the engine-side TTFTs of the requests that got their first token."""
        if itl_count <= 0 and not ttfts_s:
            return
        if self.limit is None:
            self.limit = float(min(self._cfg.engine_limit_initial, self._cfg.max_engine_running))
        if itl_count > 0:
            self._itl_sum += itl_sum_s
            self._itl_n += itl_count
        if ttfts_s:
            self._ttfts.extend(ttfts_s)
            if len(self._ttfts) > _MAX_TTFT_SAMPLES:
                self._ttfts = self._ttfts[::2]

    def _reset_window(self) -> None:
        self._itl_sum, self._itl_n, self._ttfts = 0.0, 0, []
        self._past.clear()
        self.limited = False

    def _close_interval(self) -> tuple[float, int, list[float]]:
        """Move the current interval into the sliding window; returns the window's totals."""
        cfg = self._cfg
        keep = max(1, math.ceil(cfg.engine_limit_window_s / cfg.engine_limit_interval_s - 1e-9))
        self._past.append((self._itl_sum, self._itl_n, self._ttfts))
        while len(self._past) > keep:
            self._past.popleft()
        self._itl_sum, self._itl_n, self._ttfts = 0.0, 0, []
        self.limited = False
        itl_sum = sum(b[0] for b in self._past)
        itl_n = sum(b[1] for b in self._past)
        ttfts = [x for b in self._past for x in b[2]]
        return itl_sum, itl_n, ttfts

    def due(self, now: float) -> bool:
        """Will :meth:`update` at ``now`` run the control law (or start the first interval)?"""
        return self.limit is not None and (self._next_eval is None or now >= self._next_eval)

    def update(self, now: float, outstanding: int, itl_target_s: float | None,
               ttft_target_s: float | None, queue_ratio: float = 0.0) -> None:
        """Run the control law if an interval has passed (cheap otherwise).

        Args:
            now: monotonic seconds.
            outstanding: the engine's requests dispatched and not released now.
            itl_target_s, ttft_target_s: ``ITL*`` and ``TTFT*`` (None: that signal is off).
            queue_ratio: the protected tiers' oldest queue wait ÷ their queueing budget
                (``(1 − engine_ttft_target_ratio) × TTFT SLO``); 0 when nothing protected waits.
        """
        cfg = self._cfg
        interval = cfg.engine_limit_interval_s
        if self.limit is None:
            return
        if self._next_eval is None:
            self._next_eval = now + interval
            self._reset_window()
            return
        if now < self._next_eval:
            return
        self._next_eval = now + interval
        if self._hold_until is not None:
            if outstanding <= self.limit:  # the cut took effect: judge it on the smaller batch
                self._hold_until = None
                self._reset_window()
                self._judge_at = now + JUDGE_INTERVALS * interval
            elif now >= self._hold_until:  # it could not take effect in time
                self._hold_until = None
                self._reset_window()
                self._undo(now, "the batch did not shrink to it")
            return
        limited = self.limited
        fresh = self._itl_n > 0 or bool(self._ttfts)
        itl_sum, itl_n, ttfts = self._close_interval()
        if ttfts:
            self.ttft_estimate_s = _median(ttfts)
        elif outstanding == 0:
            # an idle engine starts a request at once; without this a high estimate (a window of
            # long prefills) would outlive its requests, refuse every new one at admission, and so
            # never see the first token that would correct it
            self.ttft_estimate_s = 0.0
        ratio = 0.0
        seen = False
        if itl_n and itl_target_s:
            ratio = max(ratio, itl_sum / itl_n / itl_target_s)
            seen = True
        if ttfts and ttft_target_s:
            ratio = max(ratio, _median(ttfts) / ttft_target_s)
            seen = True
        if not itl_target_s and not ttft_target_s:
            # no protected tier seen: no latency promise to keep, so a binding limit only grows
            # (without this it would stay at engine_limit_initial and throttle batch/free traffic)
            seen = True
        if not (seen and fresh):
            return
        self.last_ratio = ratio
        ceiling = float(cfg.max_engine_running)
        if self._check is not None:
            # judge the last cut on the smaller batch's latencies
            if now < self._judge_at:
                return
            before_ratio = self._check[1]
            cut = 1.0 - cfg.engine_limit_decrease
            # (a cut from just past the target is trusted: its effect is within the noise)
            if before_ratio > 1.0 + cut and ratio > before_ratio * (1.0 - cut / 2):
                # the smaller batch is not faster: the latency is not the batch's doing (a long
                # prefill, a slow machine), so the cut only cost throughput
                self._undo(now, f"it did not lower latency/target: {before_ratio:.2f} → {ratio:.2f}")
                return
            self._check = None
            self._no_cut_windows = _NO_CUT_WINDOWS
        # past the target the limit is cut, unless protected requests wait longer (relative to their
        # queueing budget) than the latency overshoots — but never past the SLO itself
        at_slo = 1.0 / cfg.engine_itl_target_ratio
        queue_first = queue_ratio > ratio and ratio <= at_slo
        if ratio > 1.0 and not queue_first and now >= self._no_cut_until:
            new = max(float(cfg.engine_limit_min), self.limit * cfg.engine_limit_decrease)
            self._slow_start = False
            if new < self.limit:
                log.info("engine %d running limit %d → %d (latency/target %.2f, %d outstanding)", self._idx,
                         int(self.limit), max(1, int(new)), ratio, outstanding)
                self._check = (self.limit, ratio)
                self.limit = new
                self.decreases += 1
                self._hold_until = now + _MAX_HOLD_INTERVALS * interval
        elif limited and self.limit < ceiling and (ratio <= 1.0 or queue_first):
            grown = self.limit * 2.0 if self._slow_start else self.limit + cfg.engine_limit_increase
            if int(min(ceiling, grown)) != int(self.limit):
                log.debug("engine %d running limit %d → %d (latency/target %.2f)", self._idx, int(self.limit),
                          int(min(ceiling, grown)), ratio)
            self.limit = min(ceiling, grown)
            self.increases += 1

    def _undo(self, now: float, why: str) -> None:
        """Restore the limit before the last cut; no cut for a while (doubling each time)."""
        assert self.limit is not None, "update() calls _undo only once the limit is active"
        before = self._check[0] if self._check is not None else self.limit
        self._check = None
        log.info("engine %d running limit %d → %d (undoing the last cut: %s)", self._idx, int(self.limit),
                 int(before), why)
        self.limit = max(self.limit, before)
        self._slow_start = True  # the batch was not the congestion: grow as at the start
        self.undone += 1
        self._no_cut_until = now + self._no_cut_windows * self._cfg.engine_limit_window_s
        self._no_cut_windows = min(2 * self._no_cut_windows, _MAX_NO_CUT_WINDOWS)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class FirstTokenLead:
    """The first-token lead model of one replica: ``lead(tokens) = a + c × tokens`` seconds (see
    the module docstring), fitted on the last :data:`LEAD_SAMPLES` first tokens.

    Attributes:
        intercept_s: ``a``, seconds (≥ 0).
        per_token_s: ``c``, seconds per prompt token waited on (≥ 0).
        flat_above_tokens: sizes above this are projected as this size (``inf`` with a fit
            over varied sizes; the samples' mean size without one: nothing seen says how a
            larger prompt scales, so it is not extrapolated upward).
        samples: how many first tokens the fit holds (0: no model yet).
    """

    __slots__ = ("_xs", "_ys", "intercept_s", "per_token_s", "flat_above_tokens")

    def __init__(self) -> None:
        self._xs: deque[int] = deque(maxlen=LEAD_SAMPLES)
        self._ys: deque[float] = deque(maxlen=LEAD_SAMPLES)
        self.intercept_s = 0.0
        self.per_token_s = 0.0
        self.flat_above_tokens = math.inf

    @property
    def samples(self) -> int:
        return len(self._xs)

    def observe(self, tokens: int, latency_s: float) -> None:
        """Add one first token: ``tokens`` prompt tokens it waited on (≥ 0; its own and those
        dispatched before it without a first token) and its dispatch → first token seconds (≥ 0)."""
        self._xs.append(max(0, tokens))
        self._ys.append(max(0.0, latency_s))
        n = len(self._xs)
        mx = sum(self._xs) / n
        my = sum(self._ys) / n
        sxx = sum((x - mx) ** 2 for x in self._xs)
        a = c = -1.0
        if sxx > 0:
            c = sum((x - mx) * (y - my) for x, y in zip(self._xs, self._ys, strict=True)) / sxx
            a = my - c * mx
        if a >= 0 and c >= 0:
            self.intercept_s, self.per_token_s, self.flat_above_tokens = a, c, math.inf
        elif mx > 0:  # one size (or a negative fit): proportional up to the mean size, flat above
            self.intercept_s, self.per_token_s, self.flat_above_tokens = 0.0, my / mx, mx
        else:
            self.intercept_s, self.per_token_s, self.flat_above_tokens = my, 0.0, math.inf

    def lead_s(self, tokens: int) -> float:
        """Projected dispatch → first token seconds for a request waiting on ``tokens`` prompt tokens."""
        return self.intercept_s + self.per_token_s * min(max(0, tokens), self.flat_above_tokens)


class EngineGate:
    """kvmeter's view of one engine replica: its load reports, what was dispatched to it since,
    and its adaptive limit.

    Attributes:
        idx: replica index (grants carry it).
        load: the last :class:`EngineLoad` report.
        outstanding: dispatched, not released; ``unstarted``/``unstarted_tokens``: of those, the
            requests without an output token yet and their prompt tokens.
        reported: has the engine ever reported its load? ``since_report``: dispatched since.
        adaptive: the :class:`AdaptiveEngineLimit` (None when disabled by config).
        available: may it take new requests? False while a replica of a pool is down or drained
            (:meth:`~.core.SchedulerCore.set_engine_available`); what it runs goes on.
        down: closed because the replica is down (unhealthy), not drained by an operator: what
            the refusal of a pool with no replica left says (:meth:`~.core.SchedulerCore.no_replica`).
        lead: its :class:`FirstTokenLead` model.
    """

    __slots__ = ("idx", "load", "outstanding", "unstarted", "unstarted_tokens", "reported",
                 "since_report", "adaptive", "available", "down", "lead")

    def __init__(self, idx: int, config: SchedulerConfig) -> None:
        self.idx = idx
        self.load = EngineLoad()
        self.outstanding = 0
        self.unstarted = 0
        self.unstarted_tokens = 0
        self.reported = False
        self.since_report = 0
        self.adaptive = AdaptiveEngineLimit(config, idx) if config.adaptive_engine_limit else None
        self.available = True
        self.down = False
        self.lead = FirstTokenLead()

    def waiting_estimate(self) -> int:
        """Requests in the engine's own waiting queue: its last per-step report plus what was
        dispatched since; without per-step reports (none yet, or only periodic scrapes, which can
        be a second old), every dispatched request that has not started."""
        if self.reported and self.load.per_step:
            return self.load.num_waiting + self.since_report
        return self.unstarted

    @property
    def capacity(self) -> int:
        """KV capacity in tokens (0 while unknown)."""
        return self.load.kv_capacity_tokens

    def projected_used(self) -> float:
        """KV tokens in use at the last report plus prompts dispatched that have not started."""
        return self.load.kv_watermark_ratio * self.load.kv_capacity_tokens + self.unstarted_tokens

    def first_token_lead_s(self, input_tokens: int = 0) -> float:
        """Seconds a request of ``input_tokens`` prompt tokens dispatched now is expected to wait
        for its first token on this engine: :attr:`lead` for its prompt plus the unstarted prompts
        dispatched before it (module docstring); before the first sample, the adaptive limit's
        engine-side TTFT estimate (0.0 when unknown)."""
        if self.lead.samples:
            return self.lead.lead_s(self.unstarted_tokens + input_tokens)
        return self.adaptive.ttft_estimate_s if self.adaptive is not None else 0.0

    def running_limit(self, config: SchedulerConfig) -> int:
        """Most requests this engine may hold now: the static cap, or the adaptive limit below it."""
        bound = self.adaptive.bound() if self.adaptive is not None else None
        return config.max_engine_running if bound is None else min(config.max_engine_running, bound)


def open_engines(engines: Sequence[EngineGate], config: SchedulerConfig) -> list[EngineGate]:
    """The engines whose gates are open now (available — not drained nor down —, below the
    running cap and the adaptive limit, the waiting queue and the KV watermark), in index order.

    An engine stopped only by its adaptive limit is marked ``limited`` (the limit held back work:
    the evidence the control law needs before it grows the limit); call this only with work queued.
    """
    out: list[EngineGate] = []
    for e in engines:
        if not e.available:
            continue
        if e.outstanding >= config.max_engine_running:
            continue
        if e.outstanding >= e.running_limit(config):
            # (below the static cap, checked above, only an adaptive limit can stop it)
            if e.adaptive is not None:
                e.adaptive.limited = True
            continue
        if e.waiting_estimate() >= config.max_engine_waiting:
            continue
        if e.capacity:
            if e.projected_used() >= config.kv_watermark_high * e.capacity:
                continue
        elif e.load.kv_watermark_ratio >= config.kv_watermark_high:
            continue  # a watermark without a capacity (a scraped page without cache_config_info)
        out.append(e)
    return out


def free_kv(e: EngineGate) -> float:
    """An open engine's room, for the most-free-KV choice: free KV tokens (capacity − projected
    use) when its capacity is known, else minus its outstanding requests (fewer is freer)."""
    return e.capacity - e.projected_used() if e.capacity else -e.outstanding


def most_free_kv(engines: Sequence[EngineGate]) -> EngineGate | None:
    """Of ``engines``, the one with the most :func:`free_kv` (the lowest index on a tie), or None."""
    best: EngineGate | None = None
    best_free = -math.inf
    for e in engines:
        free = free_kv(e)
        if free > best_free:
            best, best_free = e, free
    return best


def pick_engine(engines: Sequence[EngineGate], config: SchedulerConfig) -> EngineGate | None:
    """The engine with the most free KV among those whose gates are open (:func:`open_engines`),
    or None."""
    return most_free_kv(open_engines(engines, config))
