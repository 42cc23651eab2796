"""Overload pressure: the level (0 normal, 1 elevated, 2 overload) that pauses and sheds tiers.

The level rises when the protected tiers' promises are at risk and falls when they are safe again:

* **inputs** — the queue fill (queued / ``max_queued_total``); the protected tiers' SLO ratio,
  the larger of (a) the oldest queued protected request's age ÷ its tier's TTFT SLO and (b) the
  mean TPOT of recently completed protected requests ÷ their tier's ITL SLO, each smoothed by an
  exponential moving average with time constant ``pressure_smoothing_s`` (a momentary burst of
  queueing sheds nobody);
* **thresholds** — a level is entered when an input reaches its threshold
  (``elevated_*``/``overload_*`` in :class:`~.config.SchedulerConfig`);
* **hysteresis and dwell** — a level is left only when every input is below
  ``pressure_exit_factor`` × its entry threshold, and only after it held ``pressure_min_dwell_s``
  (shedding improves the very inputs that set the level; without both it oscillates).

What a level *does* (pausing batch, refusing and dropping free work) is the core's
(:meth:`~.core.SchedulerCore.set_pressure_level`), driven by each tier's
:class:`~kvmeter.serving.tenancy.tiers.TierPolicy`. This module only decides the level.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

from .config import PRESSURE_ELEVATED, PRESSURE_NORMAL, PRESSURE_OVERLOAD, SchedulerConfig
from .state import TierState

__all__ = ["PressureController", "oldest_protected_wait_ratio"]

log = logging.getLogger(__name__)


def oldest_protected_wait_ratio(tiers: Iterable[TierState], now: float) -> float:
    """Largest ``age of the oldest queued request ÷ TTFT SLO`` over the protected tiers with a TTFT
    SLO and queued work (0.0 when none); ``now`` in monotonic seconds."""
    ratio = 0.0
    for tier in tiers:
        pol = tier.policy
        if not pol.protected or pol.ttft_slo_s is None or not tier.backlogged:
            continue
        oldest = tier.oldest_queued()
        wait = now - oldest.job.arrival_s if oldest is not None else 0.0
        ratio = max(ratio, wait / pol.ttft_slo_s)
    return ratio


class PressureController:
    """Decides the pressure level from queue fill and the protected tiers' SLO ratios.

    Args:
        config: thresholds, smoothing, dwell and hysteresis (:class:`SchedulerConfig`).
    Attributes:
        level: the current level (0–2).
        protected_wait_ratio: smoothed oldest protected queue wait ÷ TTFT SLO.
        protected_itl_ratio: smoothed protected TPOT ÷ ITL SLO.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.level = PRESSURE_NORMAL
        self.protected_wait_ratio = 0.0
        self.protected_itl_ratio = 0.0
        self._since = -math.inf
        self._last_t: float | None = None
        self._itl_sum = 0.0
        self._itl_n = 0

    def record_protected_tpot(self, ratio: float) -> None:
        """A protected request completed with TPOT = ``ratio`` × its tier's ITL SLO."""
        self._itl_sum += ratio
        self._itl_n += 1

    def set_level(self, level: int, now: float) -> None:
        """Record that ``level`` took effect at ``now`` (starts its dwell)."""
        self.level = level
        self._since = now

    def evaluate(self, now: float, queue_fill: float, wait_ratio: float, *, protected_active: bool = True) -> int:
        """The level the inputs call for at ``now`` (hysteresis and dwell applied).

        Args:
            now: monotonic seconds.
            queue_fill: queued / ``max_queued_total`` (0–1).
            wait_ratio: :func:`oldest_protected_wait_ratio` now (unsmoothed).
            protected_active: whether any protected request is queued or running. When none is,
                the TPOT term decays toward 0 like the wait term (no completions will refresh it,
                and a stale value would hold the level — and a paused tier — forever).
        Returns:
            0, 1 or 2 — the caller applies it when it differs from :attr:`level`.
        """
        cfg = self.config
        # a gap between evaluations counts as at most 4 intervals, so one look after a quiet spell
        # cannot swing the average; the ITL term needs ~10 completions for a full step
        dt = cfg.pressure_eval_interval_s if self._last_t is None else max(0.0, now - self._last_t)
        alpha = 1.0 - math.exp(-min(dt, 4 * cfg.pressure_eval_interval_s) / cfg.pressure_smoothing_s)
        self._last_t = now
        self.protected_wait_ratio += alpha * (wait_ratio - self.protected_wait_ratio)
        if self._itl_n:  # mean TPOT/ITL-SLO of protected requests completed since the last look
            a = alpha * min(1.0, self._itl_n / 10.0)
            self.protected_itl_ratio += a * (self._itl_sum / self._itl_n - self.protected_itl_ratio)
            self._itl_sum, self._itl_n = 0.0, 0
        elif not protected_active:
            self.protected_itl_ratio -= alpha * self.protected_itl_ratio
        ratio = max(self.protected_wait_ratio, self.protected_itl_ratio)

        def level_for(scale: float) -> int:
            if queue_fill >= scale * cfg.overload_queue_fill or ratio >= scale * cfg.overload_wait_ratio:
                return PRESSURE_OVERLOAD
            if queue_fill >= scale * cfg.elevated_queue_fill or ratio >= scale * cfg.elevated_wait_ratio:
                return PRESSURE_ELEVATED
            return PRESSURE_NORMAL

        level = max(level_for(1.0), min(self.level, level_for(cfg.pressure_exit_factor)))
        if level < self.level and now - self._since < cfg.pressure_min_dwell_s:
            level = self.level
        if level != self.level:
            log.info("scheduler pressure %d → %d (queue fill %.2f, protected wait/SLO %.2f, "
                     "ITL/SLO %.2f)", self.level, level, queue_fill, self.protected_wait_ratio,
                     self.protected_itl_ratio)
        return level
