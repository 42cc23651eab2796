"""GPU metrics from the NVML collector's :class:`~kvmeter.stats.GpuSample`,
:class:`~kvmeter.collectors.gpu.XidEvent` and :class:`~kvmeter.collectors.gpu.GpuCollectorStatus`.

Unknown readings (``None``) are never exported as 0: the series is dropped instead. Device-side
cumulative counters (energy, ECC, clock-event time, PCIe replays, NVLink bytes) become counters
through :class:`._series.CumulativeMirror`.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import CLOCK_EVENT_REASONS, GpuCollectorStatus, GpuSample, XidEvent

from ._series import CumulativeMirror, set_or_clear
from .base import MetricSource, SourceContext

__all__ = ["GpuMetrics"]

_GPM = ("sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_bandwidth_ratio")


class GpuMetrics(MetricSource):
    """Maps GPU samples, XID events and the collector status to ``kvmeter_gpu_*`` metrics."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        m = self.metric
        self.available = m("kvmeter_gpu_nvml_available")
        self.info = m("kvmeter_gpu_info")
        self.mem = {k: m(f"kvmeter_gpu_memory_{k}_bytes") for k in ("total", "used", "free", "reserved")}
        self.util = m("kvmeter_gpu_utilization_ratio")
        self.mem_util = m("kvmeter_gpu_memory_utilization_ratio")
        self.gpm = {k: m(f"kvmeter_gpu_{k}") for k in _GPM}
        self.power = m("kvmeter_gpu_power_watts")
        self.power_limit = m("kvmeter_gpu_power_limit_watts")
        self.energy = m("kvmeter_gpu_energy_joules_total")
        self.temperature = m("kvmeter_gpu_temperature_celsius")
        self.clock = m("kvmeter_gpu_clock_hertz")
        self.clock_max = m("kvmeter_gpu_clock_max_hertz")
        self.reason_active = m("kvmeter_gpu_clocks_event_reason_active")
        self.reason_seconds = m("kvmeter_gpu_clocks_event_seconds_total")
        self.xid = m("kvmeter_gpu_xid_errors_total")
        self.ecc = m("kvmeter_gpu_ecc_errors_total")
        self.remapped = m("kvmeter_gpu_remapped_rows")
        self.remap_pending = m("kvmeter_gpu_remapped_rows_pending")
        self.remap_failure = m("kvmeter_gpu_remapped_rows_failure")
        self.pcie = m("kvmeter_gpu_pcie_throughput_bytes_per_second")
        self.pcie_replays = m("kvmeter_gpu_pcie_replays_total")
        self.nvlink_links = m("kvmeter_gpu_nvlink_active_links")
        self.nvlink_bytes = m("kvmeter_gpu_nvlink_bytes_total")
        self.proc_mem = m("kvmeter_gpu_process_memory_used_bytes")
        self.mig_info = m("kvmeter_gpu_mig_info")
        self.mig_mem = {k: m(f"kvmeter_gpu_mig_memory_{k}_bytes") for k in ("total", "used", "free")}
        self.mig_sms = m("kvmeter_gpu_mig_sm_count")
        self.mig_gpm = {k: m(f"kvmeter_gpu_mig_{k}") for k in _GPM}
        self._cumulative = CumulativeMirror()
        self._procs: dict[str, set[tuple[str, str, str]]] = {}

    def attach(self, bus: StatsBus):
        return [bus.subscribe(GpuSample, self.on_sample),
                bus.subscribe(XidEvent, self.on_xid),
                bus.subscribe(GpuCollectorStatus, self.on_status)]

    def on_status(self, status: GpuCollectorStatus) -> None:
        self.available.set(1 if status.state == "ok" else 0)

    def on_xid(self, event: XidEvent) -> None:
        gpu = "" if event.gpu_index is None else str(event.gpu_index)
        self.xid.labels(gpu, str(event.xid)).inc()

    def on_sample(self, s: GpuSample) -> None:
        g = str(s.index)
        self.info.labels(g, s.uuid or "", s.name or "", s.pci_bus_id or "",
                         "" if s.mig_enabled is None else str(s.mig_enabled).lower()).set(1)
        for key, value in (("total", s.memory_total_bytes), ("used", s.memory_used_bytes),
                           ("free", s.memory_free_bytes), ("reserved", s.memory_reserved_bytes)):
            set_or_clear(self.mem[key], (g,), value)
        set_or_clear(self.util, (g,), s.utilization_gpu_ratio)
        set_or_clear(self.mem_util, (g,), s.utilization_memory_ratio)
        for key in _GPM:
            set_or_clear(self.gpm[key], (g,), getattr(s, key))
        set_or_clear(self.power, (g,), s.power_watts)
        set_or_clear(self.power_limit, (g,), s.power_limit_watts)
        self._cumulative.update(self.energy, (g,), s.energy_joules)
        set_or_clear(self.temperature, (g, "gpu"), s.temperature_gpu_celsius)
        set_or_clear(self.temperature, (g, "memory"), s.temperature_memory_celsius)
        for domain in ("graphics", "sm", "memory", "video"):
            set_or_clear(self.clock, (g, domain), s.clocks_hz.get(domain))
            set_or_clear(self.clock_max, (g, domain), s.max_clocks_hz.get(domain))
        for bit, reason in CLOCK_EVENT_REASONS.items():
            set_or_clear(self.reason_active, (g, reason),
                         None if s.clocks_event_reasons is None else float(bool(s.clocks_event_reasons & bit)))
        for reason, seconds in s.clocks_event_seconds.items():
            self._cumulative.update(self.reason_seconds, (g, reason), seconds)
        self._cumulative.update(self.ecc, (g, "corrected"), s.ecc_corrected_total)
        self._cumulative.update(self.ecc, (g, "uncorrected"), s.ecc_uncorrected_total)
        set_or_clear(self.remapped, (g, "correctable"), s.remapped_rows_correctable)
        set_or_clear(self.remapped, (g, "uncorrectable"), s.remapped_rows_uncorrectable)
        set_or_clear(self.remap_pending, (g,), None if s.remapped_rows_pending is None
                     else float(s.remapped_rows_pending))
        set_or_clear(self.remap_failure, (g,), None if s.remapped_rows_failure is None
                     else float(s.remapped_rows_failure))
        set_or_clear(self.pcie, (g, "tx"), s.pcie_tx_bytes_per_second)
        set_or_clear(self.pcie, (g, "rx"), s.pcie_rx_bytes_per_second)
        self._cumulative.update(self.pcie_replays, (g,), s.pcie_replays)
        set_or_clear(self.nvlink_links, (g,), s.nvlink_active_links)
        self._cumulative.update(self.nvlink_bytes, (g, "tx"), s.nvlink_tx_bytes)
        self._cumulative.update(self.nvlink_bytes, (g, "rx"), s.nvlink_rx_bytes)
        self._processes(g, s)
        for mig in s.mig:
            gi = "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id)
            self.mig_info.labels(g, gi, mig.profile or "", mig.uuid or "").set(1)
            for key, value in (("total", mig.memory_total_bytes), ("used", mig.memory_used_bytes),
                               ("free", mig.memory_free_bytes)):
                set_or_clear(self.mig_mem[key], (g, gi), value)
            set_or_clear(self.mig_sms, (g, gi), mig.sm_count)
            for key in _GPM:
                set_or_clear(self.mig_gpm[key], (g, gi), getattr(mig, key))

    def _processes(self, g: str, s: GpuSample) -> None:
        current = set()
        for p in s.processes:
            labels = (g, str(p.pid), (p.name or "").rsplit("/", 1)[-1])
            current.add(labels)
            set_or_clear(self.proc_mem, labels, p.used_memory_bytes)
        for gone in self._procs.get(g, set()) - current:
            set_or_clear(self.proc_mem, gone, None)
        self._procs[g] = current
