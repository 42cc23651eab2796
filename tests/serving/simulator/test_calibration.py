"""The efficiency fit recovers known factors from latencies the model itself produced."""

from __future__ import annotations

import dataclasses

import pytest

from kvmeter.serving.simulator import SimConfig
from kvmeter.serving.simulator.calibration import fit_efficiency, simulated_medians
from kvmeter.traces import load_trace


def test_fit_recovers_the_factors_that_produced_the_medians():
    reqs = [r for r in load_trace("azure-conv", limit=120) if r.input_tokens + r.output_tokens <= 8192][:24]
    truth = SimConfig(model="smollm2-135m", gpu="cpu", tp=1, compute_efficiency=0.25, memory_efficiency=0.6,
                      step_overhead_s=0.01)
    ttft, itl = simulated_medians(reqs, truth)
    fit = fit_efficiency(reqs, ttft, itl, dataclasses.replace(truth, compute_efficiency=None,
                                                                memory_efficiency=None, step_overhead_s=None),
                         compute=(0.1, 0.25, 0.5), memory=(0.3, 0.6, 0.9), overhead_s=(0.0, 0.01))
    assert fit.max_abs_error < 1e-9
    assert (fit.compute_efficiency, fit.memory_efficiency, fit.step_overhead_s) == (0.25, 0.6, 0.01)
    with pytest.raises(ValueError):
        fit_efficiency(reqs, 0.0, itl, truth)
