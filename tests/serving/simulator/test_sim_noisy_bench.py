"""``bench/noisy/sim_scenarios.py`` end to end on a short run: the simulator's records through the
real Prometheus exporter and a real chDB ledger, evaluated by the real-engine bench's own
``evaluate``/``attribute`` — the noisy tenant detected and attributed, nobody named on the clean
phase."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "noisy" / "sim_scenarios.py"


@pytest.fixture(scope="module")
def sim_scenarios():
    spec = importlib.util.spec_from_file_location("sim_scenarios", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_a_short_gpu_scale_run_detects_and_attributes_the_noisy_tenant(sim_scenarios, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert sim_scenarios.main(["--shapes", "prefill", "burst", "--clean-s", "60", "--shape-s", "60",
                               "--cooldown-s", "40", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["evaluation"]["phases"]
    assert phases["clean"]["false_positives"] == []
    for shape in ("prefill", "burst"):
        row = phases[shape]
        assert row["detected"] and row["seconds_to_detection"] <= 30, (shape, row)
        assert row["others_named"] == []
        assert row["victims_missed_ttft"] > 0 and row["attribution_share"] > 0.5, (shape, row)
    assert phases["slow"]["modelled"] is False
    assert "| prefill (`prefill_pressure`) | yes |" in capsys.readouterr().out


def test_the_kv_and_thrash_shapes_are_sized_from_the_replica(sim_scenarios):
    """The sizing rule (``size_shapes``): capacity and prefill rate → sessions, cycle and rates."""
    s = sim_scenarios.size_shapes(400_000, 8_000.0, 3_000.0, kv_watermark_above=0.7)
    assert s.spare_tokens_per_s == 5_000.0
    # kv: prompts alone reach (0.7 + 0.1) of the cache, sent prefill-bound on the spare capacity
    assert s.kv_sessions == 80 and s.kv_sessions * 4_000 >= 0.8 * 400_000 > (s.kv_sessions - 1) * 4_000
    assert s.kv_rps == 5_000.0 / 4_000
    # thrash: just above 1.1 x the cache in 8,192-token prompts, revisited as soon as spare prefill allows
    assert s.thrash_cycle == 54 and s.thrash_cycle * 8_192 >= 1.1 * 400_000 > (s.thrash_cycle - 1) * 8_192
    assert s.thrash_rps == 5_000.0 / 8_192
    assert s.thrash_period_s == 54 / (5_000.0 / 8_192)
    assert (s.kv_floor_s, s.thrash_floor_s) == (0.7 * 400_000 / 8_000.0, 400_000 / 8_000.0)
    # twice the cache: twice the cycle; twice the spare rate: half the period
    big = sim_scenarios.size_shapes(800_000, 8_000.0, 3_000.0, kv_watermark_above=0.7)
    assert big.thrash_cycle == 108 and big.kv_sessions == 160
    fast = sim_scenarios.size_shapes(400_000, 13_000.0, 3_000.0, kv_watermark_above=0.7)
    assert fast.thrash_period_s == pytest.approx(s.thrash_period_s / 2)
    with pytest.raises(ValueError, match="no spare prefill capacity"):
        sim_scenarios.size_shapes(400_000, 3_000.0, 3_000.0, kv_watermark_above=0.7)
    with pytest.raises(ValueError):
        sim_scenarios.size_shapes(400_000, 8_000.0, 0.0, kv_watermark_above=0.7, cycle_over_capacity=1.0)


def test_the_sizing_reads_the_simulated_replica(sim_scenarios):
    """``replica_rates`` reads capacity and prefill rate from the cost model: TP 2 has the smaller
    cache and the slower prefill of the two 70B H200 deployments, and its shapes are sized smaller."""
    from kvmeter.serving.simulator import SimConfig, build_cost_model

    cap4, rate4 = sim_scenarios.replica_rates(SimConfig(model="llama-3.1-70b", gpu="h200", tp=4))
    cap2, rate2 = sim_scenarios.replica_rates(SimConfig(model="llama-3.1-70b", gpu="h200", tp=2))
    assert cap4 == build_cost_model(SimConfig(tp=4)).kv_capacity_tokens
    assert cap2 < cap4 and rate2 < rate4
    cost = build_cost_model(SimConfig(tp=2))
    assert rate2 == pytest.approx(8_192 / cost.step_time(0, 0.0, [(0, 8_192)]))
    s4 = sim_scenarios.sizing_for(type("A", (), {"tp": 4, "normal_rps": 1.0})())
    s2 = sim_scenarios.sizing_for(type("A", (), {"tp": 2, "normal_rps": 1.0})())
    assert s2.thrash_cycle < s4.thrash_cycle and s2.kv_sessions < s4.kv_sessions
    assert s2.thrash_cycle * 8_192 > cap2 and s4.thrash_cycle * 8_192 > cap4
