"""The GPU page on real NVML readings (the H200 and H100-MIG captures through the capture-backed
NVML and the exporters' signal sampler) in a chDB ledger read directly (mode *b*)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from apptest import assert_clean, chart, charts, run_page
from dashkit import H200_CAPTURE, KEYS, close_dashboard_backend, stop_readers

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
from kvmeter.dashboards.config import ENV
from kvmeter.exporters.signals import SignalSampler, SignalSamplerConfig
from kvmeter.ledger import Ledger, LedgerConfig

T0 = datetime(2026, 11, 27, 2, 0, tzinfo=timezone.utc)
MIG_CAPTURE = H200_CAPTURE.with_name("linux-x86_64__nvidia-h100-mig__590.48.01.txt")


@pytest.fixture
def gpu_ledger(tmp_path: Path, monkeypatch) -> str:
    """Ten minutes of GPU signals, a sample every 10 s: GPU 0 alternates the H200 capture's idle
    and load phases; GPU 1 is the H100 in MIG mode (load phase)."""
    stop_readers()
    close_dashboard_backend()
    config = LedgerConfig(dsn=f"chdb://{tmp_path / 'chdb'}", spool_dir=tmp_path / "spool", flush_interval_s=3600,
                          rollup_interval_s=3600)
    clock = ManualClock(start_wall=T0.timestamp())
    bus = StatsBus()
    sampler = SignalSampler(bus, clock=clock, model="m", config=SignalSamplerConfig(interval_s=10.0))
    h200 = {p: NvmlCollector(CaptureNvml.from_file(H200_CAPTURE, p), clock=clock) for p in ("idle", "load")}
    mig = NvmlCollector(CaptureNvml.from_file(MIG_CAPTURE, "load"), clock=clock)
    for collector in (*h200.values(), mig):
        collector.start()
    rows = []
    for tick in range(59):
        clock.advance(10.0)
        [device] = h200["load" if (tick // 6) % 2 else "idle"].collect()
        [mig_device] = mig.collect()
        mig_device.index = 1  # both captures are a machine's GPU 0: here they are two GPUs of one host
        for instance in mig_device.mig:
            instance.gpu_index = 1
        bus.publish(device)
        bus.publish(mig_device)
        rows += sampler.sample()
    sampler.close()
    ledger = Ledger.open(config, clock=clock)
    try:
        ledger.write_signals(rows)
        assert ledger.flush(30)
    finally:
        ledger.close()
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVMETER_LEDGER_DSN", config.dsn)
    monkeypatch.setenv("KVMETER_DASHBOARD_UNTIL", (T0 + timedelta(minutes=10)).isoformat())
    monkeypatch.setenv("KVMETER_DASHBOARD_RANGE", "last 15 min")
    monkeypatch.setenv("KVMETER_DASHBOARD_REFRESH_S", "0")
    yield config.dsn
    close_dashboard_backend()


def test_gpu_page_per_device_and_mig_instance(gpu_ledger, monkeypatch):
    monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", KEYS["admin"])
    at = run_page("gpu")
    assert_clean(at)
    assert next(m.value for m in at.metric if m.label == "GPUs reporting") == "2"
    util = chart(at, "Utilization (coarse")
    devices = {row["device"] for row in _rows(at, "Utilization (coarse")}
    assert devices == {"GPU 0"}, "under MIG, NVML reports no device utilization: GPU 1 has none (not 0)"
    assert util["rows"] > 0
    assert {r["device"] for r in _rows(at, "Device memory used")} == {"GPU 0", "GPU 1"}
    mig = _rows(at, "MIG instance memory used")
    assert mig and all(r["instance"].startswith("GPU 1 · GI ") for r in mig)
    assert any("SM activity (GPM) is not reported" in i.value for i in at.info)
    assert len(charts(at)) >= 5


def test_gpu_page_is_admin_only(gpu_ledger, monkeypatch):
    monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", KEYS["acme"])
    at = run_page("gpu")
    assert_clean(at)
    assert not charts(at) and "admin key" in at.info[0].value


def _rows(at, title: str) -> list[dict]:
    from apptest import dataset_frames

    out: list[dict] = []
    for table in dataset_frames(at, title):
        out += table.to_pylist()
    return out
