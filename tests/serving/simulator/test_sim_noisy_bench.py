"""``bench/noisy/sim_scenarios.py`` end to end on a short run: the simulator's records through the
real Prometheus exporter and a real chDB ledger, evaluated by the real-engine bench's own
``evaluate``/``attribute`` — the noisy tenant detected and attributed, nobody named on the clean
phase."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "noisy" / "sim_scenarios.py"


@pytest.fixture(scope="module")
def sim_scenarios():
    spec = importlib.util.spec_from_file_location("sim_scenarios", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
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
