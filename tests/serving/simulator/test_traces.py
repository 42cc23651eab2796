"""kvmeter's one trace loader (:mod:`kvmeter.traces`) in what the simulator needs of it: trace
windows, Mooncake block hashes, kvmeter's own tenant-attributed CSV and the data-folder override."""

from __future__ import annotations

import pytest

from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.traces import TraceError, TraceNotFoundError, TraceRequest, data_dir, load_trace


def test_azure_trace_parses_seven_digit_timestamps_from_zero():
    reqs = load_trace("azure-conv", limit=3)
    # 18:15:46.6805900 → 18:15:50.9951690 is 4.314579 s
    assert [r.arrival_s for r in reqs[:2]] == pytest.approx([0.0, 4.314579])
    assert (reqs[0].input_tokens, reqs[0].output_tokens) == (374, 44)
    assert all(r.tenant_id is None and r.tier is None for r in reqs)


@pytest.mark.parametrize("limit", [0, -5])
def test_a_limit_below_one_is_a_trace_error(limit):
    with pytest.raises(TraceError, match="limit"):
        load_trace("azure-conv", limit=limit)


def test_windows_shift_arrivals_to_their_start_and_limit_counts_inside_the_window():
    full = load_trace("azure-conv")
    win = load_trace("azure-conv", start_s=600.0, duration_s=60.0)
    inside = [r for r in full if 600.0 <= r.arrival_s < 660.0]
    assert len(win) == len(inside) > 0
    assert [r.arrival_s for r in win] == pytest.approx([r.arrival_s - 600.0 for r in inside])
    assert [r.input_tokens for r in win] == [r.input_tokens for r in inside]
    assert len(load_trace("azure-conv", limit=5, start_s=600.0, duration_s=60.0)) == 5
    with pytest.raises(TraceError, match="window"):
        load_trace("azure-conv", duration_s=0.0)


def test_mooncake_trace_carries_hash_ids_and_durations_filter():
    reqs = load_trace("mooncake", duration_s=5.0)
    assert reqs and all(r.arrival_s < 5.0 for r in reqs)
    assert reqs[0].hash_ids[:3] == (0, 1, 2) and len(reqs[0].hash_ids) == -(-reqs[0].input_tokens // 512)


def test_data_dir_env_override_and_kvmeter_csv_format(tmp_path, monkeypatch):
    (tmp_path / "traces").mkdir()
    p = tmp_path / "traces" / "mine.csv"
    p.write_text("arrival_s,input_tokens,output_tokens,tenant_id,tier,deadline_s\n"
                 "5.0,10,3,acme,free,\n1.0,20,4,zed,batch,9.5\n2.0,0,4,tiny,,\n")
    monkeypatch.setenv("KVMETER_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    reqs = load_trace(p)
    assert reqs == [TraceRequest(0.0, 20, 4, tenant_id="zed", tier="batch", deadline_s=8.5),
                    TraceRequest(1.0, 1, 4, tenant_id="tiny"),          # lengths below 1 are raised to 1
                    TraceRequest(4.0, 10, 3, tenant_id="acme", tier="free")]
    with pytest.raises(FileNotFoundError, match="azure-conv"):
        load_trace("azure-conv")   # the override points at a folder without it
    with pytest.raises(TraceNotFoundError):
        load_trace("no-such-trace")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="unknown CSV trace columns"):
        load_trace(bad)


@pytest.mark.parametrize("rows", ["1.0,10,3\n,20,4\n", ",10,3\n,20,4\n"], ids=["one-empty", "all-empty"])
def test_an_empty_arrival_time_in_a_kvmeter_csv_is_a_trace_error(tmp_path, rows):
    # (with every arrival_s empty the first-arrival reference was None: a TypeError, not a TraceError)
    p = tmp_path / "gaps.csv"
    p.write_text("arrival_s,input_tokens,output_tokens\n" + rows)
    with pytest.raises(TraceError, match="empty arrival_s"):
        load_trace(p)


def test_the_simulator_replays_a_kvmeter_csv_with_its_tenants_tiers_and_deadlines(tmp_path):
    p = tmp_path / "w.csv"
    p.write_text("arrival_s,input_tokens,output_tokens,tenant_id,tier,deadline_s\n"
                 "0.0,100,10,acme,enterprise,\n0.5,200,20,zed,free,\n1.0,50,5,,,\n")
    res = Simulation(load_trace(p), policy="vtc", sim=SimConfig(model="smollm2-135m", gpu="cpu", tp=1)).run()
    got = sorted((r.tenant_id, r.tier, r.outcome, r.generated) for r in res.records)
    assert got == [("acme", "enterprise", "ok", 10), ("default", "paid_interactive", "ok", 5),
                   ("zed", "free", "ok", 20)]
