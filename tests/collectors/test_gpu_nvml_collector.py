"""The real NVML collector driven through the capture-backed pynvml stand-in (no GPU here).

Fault injection (sentinels, NVML errors, GPM, XID) uses small subclasses of the stand-in; each
says what it fakes. Everything else is read from the real captures.
"""

from __future__ import annotations

import json
import threading

import pynvml
import pytest

from kvmeter.bus import StatsBus
from kvmeter.cli import main as kvmeter_main
from kvmeter.clock import ManualClock
from kvmeter.collectors.gpu import (
    CaptureNvml,
    GpuPoller,
    NvmlCollector,
)
from kvmeter.stats import GpuCollectorStatus, GpuSample, XidEvent

MIB = 1024 * 1024
H100 = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
H100_MIG = "linux-x86_64__nvidia-h100-mig__590.48.01.txt"
H200 = "linux-x86_64__nvidia-h200__590.48.01.txt"
A100_XML = "telegraf_a100-sxm4-v12.xml"
ALL = [H100, H100_MIG, H200, A100_XML]


def capture(data_dir, name, phase="load", cls=CaptureNvml):
    return cls.from_file(data_dir / "gpu" / "nvidia_smi" / name, phase)


def collect_one(nvml, **kw):
    collector = NvmlCollector(nvml, clock=ManualClock(), **kw)
    assert collector.start().state == "ok"
    samples = collector.collect()
    assert len(samples) == 1
    return collector, samples[0]


@pytest.mark.parametrize("name", ALL)
def test_every_capture_collects_cleanly(data_dir, name):
    collector, s = collect_one(capture(data_dir, name))
    assert collector.missing_functions == set()  # the collector calls only implemented API
    assert collector.status.read_errors == {}
    assert collector.status.device_count == 1
    total, used, free = s.memory_total_bytes, s.memory_used_bytes, s.memory_free_bytes
    assert abs(total - used - free - s.memory_reserved_bytes) <= 2 * MIB  # nvidia-smi MiB rounding
    # absent from every capture → missing, never 0
    assert s.energy_joules is None and s.nvlink_tx_bytes is None and s.nvlink_rx_bytes is None
    assert s.sm_active_ratio is None and s.dram_bandwidth_ratio is None


def test_h200_values_in_si_units(data_dir):
    collector, s = collect_one(capture(data_dir, H200))
    assert collector.status.driver_version == "590.48.01"
    assert (s.name, s.uuid, s.pci_bus_id, s.mig_enabled) == (
        "NVIDIA H200", "GPU-00000000-0000-0000-0000-000000000000", "00000000:83:00.0", False)
    assert s.memory_total_bytes == 143771 * MIB and s.memory_used_bytes == 32362 * MIB
    assert s.memory_reserved_bytes == 614 * MIB and s.memory_free_bytes == 110796 * MIB
    assert s.utilization_gpu_ratio == pytest.approx(1.0) and s.utilization_memory_ratio == pytest.approx(0.07)
    assert s.power_watts == pytest.approx(627.32) and s.power_limit_watts == pytest.approx(700.0)
    assert s.temperature_gpu_celsius == 52.0 and s.temperature_memory_celsius == 41.0
    assert s.clocks_hz == {"graphics": 1.98e9, "sm": 1.98e9, "memory": 3.201e9, "video": 1.545e9}
    assert s.max_clocks_hz["memory"] == 3.201e9
    assert s.clocks_event_reasons == 0 and s.active_clock_event_reasons == ()
    assert s.clocks_event_seconds == {r: 0.0 for r in (
        "sw_power_cap", "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")}
    assert (s.ecc_corrected_total, s.ecc_uncorrected_total) == (0, 0)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable,
            s.remapped_rows_pending, s.remapped_rows_failure) == (0, 0, False, False)
    assert s.pcie_tx_bytes_per_second == 4217e3 and s.pcie_rx_bytes_per_second == 8691e3
    assert s.pcie_replays == 0 and s.nvlink_active_links == 18
    assert [(p.pid, p.name, p.used_memory_bytes, p.gpu_instance_id) for p in s.processes] == [
        (10291, "/root/tools/memhog", 2566 * MIB, None), (10293, "/root/tools/memhog", 1542 * MIB, None),
        (10309, "./gpu_burn", 28234 * MIB, None)]
    assert sum(p.used_memory_bytes for p in s.processes) < s.memory_used_bytes
    assert s.mig == []


def test_idle_phase_reports_the_idle_clock_reason(data_dir):
    _, s = collect_one(capture(data_dir, H100, "idle"))
    assert s.active_clock_event_reasons == ("gpu_idle",)
    assert s.utilization_gpu_ratio == 0.0  # a real 0 %, read as 0 — not missing
    assert s.processes == []


def test_mig_capture(data_dir):
    _, s = collect_one(capture(data_dir, H100_MIG))
    assert s.mig_enabled is True
    assert s.utilization_gpu_ratio is None and s.utilization_memory_ratio is None  # [N/A] under MIG
    assert s.remapped_rows_correctable is None and s.remapped_rows_pending is None
    assert s.nvlink_active_links is None  # "Nvlink queries are not supported for Devices in MIG mode"
    assert [(m.mig_index, m.gpu_instance_id, m.compute_instance_id, m.profile, m.sm_count) for m in s.mig] == [
        (0, 2, 0, "3g.40gb", 60), (1, 3, 0, "2g.20gb", 32), (2, 9, 0, "1g.10gb", 16), (3, 10, 0, "1g.10gb", 16)]
    big = s.mig[0]
    assert big.uuid == "MIG-00000000-0000-0000-0000-000000000000"
    assert (big.memory_total_bytes, big.memory_used_bytes, big.memory_free_bytes) == (
        40448 * MIB, 11091 * MIB, 29357 * MIB)
    assert [p.pid for p in big.processes] == [21180, 21181, 21198]
    assert all(m.processes == [] for m in s.mig[1:])
    assert {p.gpu_instance_id for p in s.processes} == {2} and {p.compute_instance_id for p in s.processes} == {0}


def test_a100_xml_mig_without_listing(data_dir):
    _, s = collect_one(capture(data_dir, A100_XML))
    assert s.name == "NVIDIA A100-SXM4-80GB" and s.mig_enabled is True
    assert [m.gpu_instance_id for m in s.mig] == [3, 4, 5, 6]
    assert all(m.profile is None and m.uuid is None for m in s.mig)  # the XML holds neither
    assert all(v is None for v in s.clocks_event_seconds.values())  # no counters in DTD v12
    assert s.power_limit_watts == pytest.approx(500.0)


def test_no_gpu_is_a_state_not_a_crash():
    """This machine has no NVIDIA library: the real pynvml raises LibraryNotFound."""
    bus = StatsBus()
    seen = []
    bus.subscribe(GpuCollectorStatus, seen.append)
    collector = NvmlCollector(bus=bus, clock=ManualClock())  # real pynvml
    status = collector.start()
    assert status.state == "no_gpu" and "Library Not Found" in status.reason
    assert collector.collect() == [] and collector.poll_xid() == []
    assert [s.state for s in seen] == ["no_gpu"]
    collector.close()  # no-op, no error
    assert bus.errors_total == 0


def test_samples_and_status_are_published(data_dir):
    bus = StatsBus()
    got: list = []
    bus.subscribe(GpuSample, got.append)
    bus.subscribe(GpuCollectorStatus, got.append)
    collector = NvmlCollector(capture(data_dir, H200), bus=bus, clock=ManualClock(start_wall=1.75e9))
    collector.collect()  # starts on first use
    assert [type(x).__name__ for x in got] == ["GpuSample", "GpuCollectorStatus"]
    assert got[0].wall_ts == 1.75e9 and got[1].state == "ok"


def test_xid_events_are_event_driven(data_dir):
    nvml = capture(data_dir, H100_MIG)
    bus = StatsBus()
    events: list[XidEvent] = []
    bus.subscribe(XidEvent, events.append)
    collector = NvmlCollector(nvml, bus=bus, clock=ManualClock())
    assert collector.start().xid_events_supported
    assert collector.poll_xid(timeout_ms=0) == []  # nothing captured → timeout, no event
    nvml.inject_xid(0, 79)  # synthetic: no XID appears in any capture
    nvml.inject_xid(0, 43, gpu_instance_id=2, compute_instance_id=0)
    polled = collector.poll_xid(timeout_ms=100)
    assert [(e.gpu_index, e.xid, e.gpu_instance_id, e.compute_instance_id) for e in polled] == [
        (0, 79, None, None), (0, 43, 2, 0)]
    assert events == polled
    assert collector.poll_xid() == []
    collector.close()
    assert collector.status.state == "closed"


class _Faulty(CaptureNvml):
    """Fault injection: NVML sentinels and a lost-GPU error on top of a real capture."""

    def nvmlDeviceGetPowerUsage(self, handle):
        return 0xFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE_uint

    def nvmlDeviceGetTemperature(self, handle, sensor):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        procs = super().nvmlDeviceGetComputeRunningProcesses(handle)
        procs[0].usedGpuMemory = None  # what pynvml returns for NVML_VALUE_NOT_AVAILABLE
        return procs


def test_sentinels_and_errors_become_missing(data_dir):
    collector, s = collect_one(capture(data_dir, H200, cls=_Faulty))
    assert s.power_watts is None  # sentinel, not 4294967 W
    assert s.temperature_gpu_celsius is None
    assert collector.status.read_errors == {"NVMLError_GpuIsLost": 1}
    assert s.processes[0].used_memory_bytes is None and s.processes[1].used_memory_bytes == 1542 * MIB
    assert s.memory_used_bytes == 32362 * MIB  # the rest still reads


class _WithGpm(CaptureNvml):
    """Synthetic GPM: the captures hold no GPM counters, so this fakes the device side of the GPM
    API (support query, samples, metrics) to drive the collector's GPM code path."""

    VALUES = {pynvml.NVML_GPM_METRIC_SM_UTIL: 62.5, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 31.0,
              pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0}  # DRAM_BW: not supported here
    freed = 0
    mig_samples: list = []

    def nvmlGpmQueryDeviceSupport(self, handle):
        support = super().nvmlGpmQueryDeviceSupport(handle)
        support.isSupportedDevice = 1
        return support

    def nvmlGpmSampleAlloc(self):
        return pynvml.c_nvmlGpmSample_t()  # the real (opaque) pointer type the struct demands

    def nvmlGpmSampleGet(self, handle, sample):
        return sample

    def nvmlGpmMigSampleGet(self, handle, gpu_instance_id, sample):
        self.mig_samples.append(gpu_instance_id)
        return sample

    def nvmlGpmSampleFree(self, sample):
        type(self).freed += 1

    def nvmlGpmMetricsGet(self, get):
        assert get.version == pynvml.NVML_GPM_METRICS_GET_VERSION and get.numMetrics == 4
        for i in range(get.numMetrics):
            metric = get.metrics[i]
            if metric.metricId in self.VALUES:
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, self.VALUES[metric.metricId]
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return get


def test_gpm_needs_two_samples_and_maps_percent_to_ratio(data_dir):
    collector = NvmlCollector(capture(data_dir, H100_MIG, cls=_WithGpm), clock=ManualClock())
    first = collector.collect()[0]
    assert first.sm_active_ratio is None  # GPM is a rate between two samples
    second = collector.collect()[0]
    assert second.sm_active_ratio == pytest.approx(0.625)
    assert second.sm_occupancy_ratio == pytest.approx(0.31)
    assert second.tensor_active_ratio == pytest.approx(0.40)
    assert second.dram_bandwidth_ratio is None  # per-metric NOT_SUPPORTED stays missing
    assert [m.sm_active_ratio for m in second.mig] == [pytest.approx(0.625)] * 4
    assert sorted(set(_WithGpm.mig_samples)) == [2, 3, 9, 10]  # per GPU instance
    assert _WithGpm.freed == 5  # the previous sample of the GPU and of each MIG instance
    collector.close()


def test_stand_in_refuses_api_it_does_not_implement(data_dir):
    nvml = capture(data_dir, H200)
    with pytest.raises(AttributeError, match="nvmlDeviceGetBoardId"):
        _ = nvml.nvmlDeviceGetBoardId
    assert nvml.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU  # constants pass through
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_poller_publishes_until_stopped(data_dir):
    bus = StatsBus()
    arrived = threading.Event()
    bus.subscribe(GpuSample, lambda s: arrived.set())
    poller = GpuPoller(NvmlCollector(capture(data_dir, H200), bus=bus), interval_s=0.05)
    poller.start()
    try:
        assert arrived.wait(timeout=10), "no GPU sample from the poller thread"
    finally:
        poller.stop()
    assert poller.collector.status.state == "closed"
    with pytest.raises(ValueError):
        GpuPoller(poller.collector, interval_s=0)


def test_cli_reads_a_capture_as_json(data_dir, capsys):
    path = data_dir / "gpu" / "nvidia_smi" / H100_MIG
    assert kvmeter_main(["gpu", "--capture", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"]["state"] == "ok"
    gpu = out["gpus"][0]
    assert gpu["utilization_gpu_ratio"] is None and len(gpu["mig"]) == 4
    assert gpu["memory_used_bytes"] == 11125 * MIB


def test_cli_without_gpu(capsys):
    assert kvmeter_main(["gpu"]) == 0
    assert "no_gpu" in capsys.readouterr().out
    assert kvmeter_main(["gpu", "--require-gpu"]) == 3


class _OldDriverMig(CaptureNvml):
    """Fault injection: a driver that lists MIG processes only on the MIG device handles."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [] if handle.mig is None else super().nvmlDeviceGetComputeRunningProcesses(handle)


def test_mig_processes_read_from_mig_handles_when_the_parent_lists_none(data_dir):
    _, s = collect_one(capture(data_dir, H100_MIG, cls=_OldDriverMig))
    assert [p.pid for p in s.mig[0].processes] == [21180, 21181, 21198]
    assert [p.pid for p in s.processes] == [21180, 21181, 21198]
    assert {p.gpu_instance_id for p in s.processes} == {2}
