"""Stats of a vLLM server kvmeter does not host, from successive scrapes of its ``/metrics``
(:class:`~kvmeter.collectors.remote_vllm.RemoteVllmScraper`, owned by the remote engine).

A :class:`RemoteEngineStats` is one engine (``model_name`` × ``engine`` label) between two scrapes:
current gauges, reset-aware counter deltas and rates, and the latency histograms' windows with
their quantiles (interpolated within buckets as Prometheus' ``histogram_quantile`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RemoteEngineStats", "HistogramSnapshot", "CounterAnomaly"]


@dataclass(slots=True)
class RemoteEngineStats:
    """One remote engine between two scrapes — the plain stats the exporters consume.

    Attributes:
        source: the scraped URL; model_name, engine: the engine's labels.
        wall_ts: wall-clock epoch seconds of this scrape.
        interval_s: monotonic seconds since the previous scrape (``None`` on the first).
        kv_cache_usage_ratio: KV watermark, 0.0–1.0 (``None`` if not exposed or invalid).
        kv_blocks_total, kv_block_size_tokens: from ``cache_config_info`` (``None`` if absent).
        num_running, num_waiting, num_swapped: current gauges (``None`` if absent).
        prefix_cache_hit_rate: V0's gauge, 0.0–1.0 (``None`` if absent or disabled).
        deltas: canonical counter → increase since the previous scrape (first scrape: absent).
        rates_per_s: canonical counter → deltas / interval_s.
        windows: canonical histogram → observations since the previous scrape (on the first
            scrape, or after a reset: since the histogram was created).
        quantiles: canonical histogram → {q: seconds or tokens} of the window (``None`` where
            the count is unknown or zero).
        anomalies: counter resets and invalid decreases seen in this scrape.
    """

    source: str
    model_name: str
    engine: str
    wall_ts: float
    interval_s: float | None = None
    kv_cache_usage_ratio: float | None = None
    kv_blocks_total: int | None = None
    kv_block_size_tokens: int | None = None
    num_running: float | None = None
    num_waiting: float | None = None
    num_swapped: float | None = None
    prefix_cache_hit_rate: float | None = None
    deltas: dict[str, float] = field(default_factory=dict)
    rates_per_s: dict[str, float] = field(default_factory=dict)
    windows: dict[str, HistogramSnapshot] = field(default_factory=dict)
    quantiles: dict[str, dict[float, float | None]] = field(default_factory=dict)
    anomalies: list[CounterAnomaly] = field(default_factory=list)

    @property
    def engine_id(self) -> str:
        """A label value naming this engine across sources: ``<source>#<engine>``."""
        return f"{self.source}#{self.engine}"


@dataclass(slots=True)
class HistogramSnapshot:
    """A cumulative (or window) Prometheus histogram.

    Attributes:
        buckets: ``(upper bound, cumulative count)`` sorted by bound; includes ``(inf, count)``
            when the exposition had a ``+Inf`` bucket or a ``_count``.
        sum: sum of observations (``None`` if absent).
        count: observations (``None`` when neither ``+Inf`` nor ``_count`` was exposed).
        created: the histogram's ``_created`` timestamp (epoch seconds) if exposed.
    """

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float | None = None
    count: float | None = None
    created: float | None = None

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 ≤ q ≤ 1) by linear interpolation inside the bucket holding it.

        Follows Prometheus' ``histogram_quantile``: the lowest bucket's lower bound is 0, and a
        rank in the ``+Inf`` bucket returns the largest finite bound. ``None`` if the count is
        unknown or zero.

        Raises:
            ValueError: if ``q`` is outside [0, 1].
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if not self.count or not self.buckets or self.buckets[-1][0] != math.inf:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if bound == math.inf:
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower

    def minus(self, older: "HistogramSnapshot") -> "HistogramSnapshot | None":
        """Bucket-wise ``self − older`` (the observations between two scrapes).

        Returns ``None`` if the bucket layouts differ or any bucket decreased.
        """
        if [b for b, _ in self.buckets] != [b for b, _ in older.buckets]:
            return None
        buckets = [(b, c - o) for (b, c), (_, o) in zip(self.buckets, older.buckets, strict=True)]
        if any(c < 0 for _, c in buckets):
            return None
        count = None if self.count is None or older.count is None else self.count - older.count
        total = None if self.sum is None or older.sum is None else self.sum - older.sum
        return HistogramSnapshot(buckets, total, count, self.created)


@dataclass(slots=True)
class CounterAnomaly:
    """A counter that went down between two scrapes.

    Attributes:
        series: ``<canonical name>{model_name=..., engine=...}``.
        previous, current: the two values.
        kind: ``reset`` (counted from the new value) or ``invalid`` (not counted).
        reason: why it was judged so.
    """

    series: str
    previous: float
    current: float
    kind: str
    reason: str
