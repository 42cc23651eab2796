"""The tenant split the simulator replays real traces with (traces themselves load through
:func:`kvmeter.traces.load_trace`, kvmeter's one trace loader).

**Tenant mapping.** The Azure and Mooncake traces carry no tenant. ServeGen's per-client rates
(``servegen_m-large_perclient_2days.csv``: 162 clients × 10-minute windows of Alibaba's
production traffic) are the public per-tenant split. :class:`ServeGenTenantMap` takes one hour of
it (by default the busiest hour) and gives each trace request, at trace offset ``t``, the client
drawn with probability proportional to that client's rate in the ServeGen window at the same
offset (seeded, so runs repeat). Arrivals and token counts stay the trace's; the split — a few
clients carrying most of the traffic, most clients light, shares that move every 10 minutes — is
ServeGen's. Tenants map to tiers by a stable hash of the tenant id into the tier split
(default 10 % enterprise, 50 % paid interactive, 15 % batch, 25 % free), or by a JSON map.

:func:`servegen_arrivals` instead generates arrivals from ServeGen itself (each client's window
rate and coefficient of variation, gamma inter-arrival times matching both moments), with token
lengths drawn from a real trace — the per-client workload of the fairness benchmark.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import polars as pl

from kvmeter.traces import TRACE_FILES, TraceRequest, data_file

__all__ = [
    "load_servegen_rates", "busiest_hour_start", "ServeGenTenantMap", "servegen_arrivals",
    "tier_for_tenant", "load_tier_map", "DEFAULT_TIER_SPLIT",
]

#: Tier → fraction of tenants (hash split).
DEFAULT_TIER_SPLIT: Mapping[str, float] = {
    "enterprise": 0.10, "paid_interactive": 0.50, "batch": 0.15, "free": 0.25}


# ---------------------------------------------------------------------------- ServeGen
def load_servegen_rates(path: str | os.PathLike | None = None) -> pl.DataFrame:
    """ServeGen per-client windows: client_id, window_start_s, rate_rps, cv (rate 0 → idle).

    Args:
        path: a CSV in that format; default the data folder's ServeGen file
            (:func:`kvmeter.traces.data_file`).
    Raises:
        FileNotFoundError, ValueError: missing file or columns (a missing data-folder file is a
            :class:`kvmeter.traces.DataNotFoundError`, which names the folder and its override).
    """
    p = Path(path) if path is not None else data_file(TRACE_FILES["servegen-rates"])
    if not p.is_file():
        raise FileNotFoundError(f"ServeGen rates not found at {p}")
    df = pl.read_csv(p)
    need = {"client_id", "window_start_s", "rate_rps", "cv"}
    if not need <= set(df.columns):
        raise ValueError(f"{p}: needs columns {sorted(need)}, has {df.columns}")
    return df.select(pl.col("client_id").cast(pl.Int64), pl.col("window_start_s").cast(pl.Int64),
                     pl.col("rate_rps").cast(pl.Float64).fill_null(0.0),
                     pl.col("cv").cast(pl.Float64).fill_null(0.0))


def busiest_hour_start(rates: pl.DataFrame, duration_s: int = 3600) -> int:
    """Start (seconds, a window boundary) of the ``duration_s`` span with the most traffic."""
    per_window = rates.group_by("window_start_s").agg(pl.col("rate_rps").sum()).sort("window_start_s")
    starts = per_window["window_start_s"].to_list()
    totals = per_window["rate_rps"].to_list()
    step = starts[1] - starts[0] if len(starts) > 1 else 600
    n = max(1, duration_s // step)
    best, best_sum = starts[0], -1.0
    for i in range(0, max(1, len(starts) - n + 1)):
        s = sum(totals[i:i + n])
        if s > best_sum:
            best, best_sum = starts[i], s
    return int(best)


def tier_for_tenant(tenant_id: str, split: Mapping[str, float] = DEFAULT_TIER_SPLIT) -> str:
    """Stable tier of ``tenant_id``: its SHA-256 mapped to [0, 1) and cut by ``split``'s fractions.

    Raises:
        ValueError: if the split is empty or its fractions are not positive.
    """
    if not split or any(v <= 0 for v in split.values()):
        raise ValueError(f"tier split needs positive fractions, got {dict(split)}")
    total = sum(split.values())
    x = int.from_bytes(hashlib.sha256(tenant_id.encode()).digest()[:8], "big") / 2 ** 64 * total
    acc = 0.0
    for tier, frac in split.items():
        acc += frac
        if x < acc:
            return tier
    return next(reversed(list(split)))


class ServeGenTenantMap:
    """Assigns trace requests to ServeGen clients (tenants) and tenants to tiers.

    Args:
        rates: :func:`load_servegen_rates` output.
        start_s: ServeGen offset the trace's t=0 maps to (default: :func:`busiest_hour_start`).
        seed: RNG seed of the draws.
        tier_split: tier → fraction of tenants (hash split), used when ``tier_map`` lacks one.
        tier_map: explicit tenant id → tier.
        prefix: tenant id prefix (``sg-<client_id>``).
    """

    def __init__(self, rates: pl.DataFrame, *, start_s: int | None = None, seed: int = 0,
                 tier_split: Mapping[str, float] = DEFAULT_TIER_SPLIT,
                 tier_map: Mapping[str, str] | None = None, prefix: str = "sg-") -> None:
        self.rates = rates
        self.start_s = busiest_hour_start(rates) if start_s is None else int(start_s)
        self.seed = seed
        self.tier_split = dict(tier_split)
        self.tier_map = dict(tier_map or {})
        self.prefix = prefix
        windows = rates.select("window_start_s").unique().sort("window_start_s")["window_start_s"].to_list()
        self._window = windows[1] - windows[0] if len(windows) > 1 else 600
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tier_of(self, tenant_id: str) -> str:
        return self.tier_map.get(tenant_id) or tier_for_tenant(tenant_id, self.tier_split)

    def _distribution(self, window_start: int) -> tuple[np.ndarray, np.ndarray]:
        if window_start not in self._cache:
            w = self.rates.filter((pl.col("window_start_s") == window_start) & (pl.col("rate_rps") > 0))
            if w.is_empty():  # an idle window: fall back to the whole mapped hour
                w = (self.rates.filter((pl.col("window_start_s") >= self.start_s) &
                                       (pl.col("window_start_s") < self.start_s + 3600))
                     .group_by("client_id").agg(pl.col("rate_rps").sum()).filter(pl.col("rate_rps") > 0))
            if w.is_empty():
                raise ValueError(f"ServeGen has no traffic around {window_start} s")
            ids = w["client_id"].to_numpy()
            p = w["rate_rps"].to_numpy()
            self._cache[window_start] = (ids, p / p.sum())
        return self._cache[window_start]

    def assign(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """Copies of ``requests`` with tenant and tier set (see the module docstring)."""
        rng = np.random.default_rng(self.seed)
        out = []
        for r in requests:
            w = self.start_s + int(r.arrival_s // self._window) * self._window
            ids, p = self._distribution(w)
            client = int(ids[rng.choice(len(ids), p=p)])
            tenant = f"{self.prefix}{client}"
            out.append(replace(r, tenant_id=tenant, tier=self.tier_of(tenant)))
        return out


def servegen_arrivals(rates: pl.DataFrame, *, start_s: int, duration_s: float, lengths: Sequence[TraceRequest],
                      total_rate_rps: float | None = None, seed: int = 0,
                      tier_of=None, prefix: str = "sg-") -> list[TraceRequest]:
    """Generate per-client arrivals from ServeGen windows, lengths sampled from ``lengths``.

    Each client's arrivals in a window are a renewal process with gamma inter-arrival times of the
    window's mean (1/rate) and coefficient of variation (``cv``; 1 — Poisson — when missing).
    ``total_rate_rps`` rescales every rate so the mean total matches it (ServeGen's absolute rates
    are for a whole cluster).

    Returns:
        requests sorted by arrival. Raises ValueError for empty inputs or a non-positive rate.
    """
    if not lengths:
        raise ValueError("servegen_arrivals needs a non-empty list of requests to draw lengths from")
    span = rates.filter((pl.col("window_start_s") >= start_s) &
                        (pl.col("window_start_s") < start_s + duration_s) & (pl.col("rate_rps") > 0))
    if span.is_empty():
        raise ValueError(f"ServeGen has no traffic in [{start_s}, {start_s + duration_s}) s")
    windows = sorted(set(rates["window_start_s"].to_list()))
    wlen = windows[1] - windows[0] if len(windows) > 1 else 600
    scale = 1.0
    if total_rate_rps is not None:
        if not total_rate_rps > 0:
            raise ValueError(f"total_rate_rps must be > 0, got {total_rate_rps}")
        mean_total = float(span["rate_rps"].sum()) * wlen / duration_s  # (a Float64 column)
        scale = total_rate_rps / mean_total
    rng = np.random.default_rng(seed)
    pool = np.arange(len(lengths))
    out: list[TraceRequest] = []
    for client, w0, rate, cv in span.select("client_id", "window_start_s", "rate_rps", "cv").iter_rows():
        lam = rate * scale
        cv = cv if cv and math.isfinite(cv) and cv > 0 else 1.0
        shape = 1.0 / (cv * cv)
        mean = 1.0 / lam
        t = w0 - start_s + rng.exponential(mean)  # renewal start: stationary-ish first arrival
        end = min(w0 - start_s + wlen, duration_s)
        tenant = f"{prefix}{client}"
        tier = tier_of(tenant) if tier_of else tier_for_tenant(tenant)
        while t < end:
            src = lengths[int(rng.choice(pool))]
            out.append(TraceRequest(arrival_s=float(t), input_tokens=src.input_tokens,
                                    output_tokens=src.output_tokens, tenant_id=tenant, tier=tier))
            t += rng.gamma(shape, mean / shape)
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_tier_map(path: str | os.PathLike) -> dict[str, str]:
    """A JSON object tenant id → tier. Raises ValueError on anything else."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{path}: a tier map must be a JSON object of tenant id → tier name")
    return data
