"""The NVML collector: reads every GPU (and MIG device) through ``pynvml`` into plain samples.

Use::

    collector = NvmlCollector(bus=bus)          # real pynvml (nvidia-ml-py)
    status = collector.start()                  # GpuCollectorStatus: ok / no_gpu / error
    samples = collector.collect()               # list[GpuSample], also published on the bus
    events = collector.poll_xid(timeout_ms=0)   # list[XidEvent], also published

``nvml`` may be any object with pynvml's functions and constants — the real module, or the
capture-backed :class:`~kvmeter.collectors.gpu.capture_nvml.CaptureNvml` in tests.

Failure rules (never crash the host):

* no NVIDIA library or driver (``NVML_ERROR_LIBRARY_NOT_FOUND`` / ``DRIVER_NOT_LOADED``) → status
  ``no_gpu``; :meth:`collect` returns ``[]`` and publishes only the status;
* a reading the device does not support (``NOT_SUPPORTED``, ``NOT_FOUND``, ``NO_DATA``,
  ``FUNCTION_NOT_FOUND``, a function this pynvml lacks) → that field is ``None``;
* any other NVML error on a reading → that field is ``None`` and the error is counted in
  :attr:`GpuCollectorStatus.read_errors`;
* NVML's "value not available" sentinels (``0xFFFFFFFF``, ``0xFFFFFFFFFFFFFFFF``) → ``None``.

Not thread-safe: one thread calls :meth:`collect` / :meth:`poll_xid` (see :mod:`.poller`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock

from kvmeter.stats import GpuCollectorStatus, GpuProcessSample, GpuSample, MigSample, XidEvent

__all__ = ["NvmlCollector"]

log = logging.getLogger(__name__)

_SENTINELS = (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)

# NVML error codes (nvml.h); kept literal so this module imports without pynvml
_ERR_INVALID_ARGUMENT, _ERR_NOT_SUPPORTED, _ERR_NOT_FOUND = 2, 3, 6
_ERR_DRIVER_NOT_LOADED, _ERR_TIMEOUT = 9, 10
_ERR_LIBRARY_NOT_FOUND, _ERR_FUNCTION_NOT_FOUND, _ERR_NO_DATA = 12, 13, 21
_MISSING_CODES = {_ERR_NOT_SUPPORTED, _ERR_NOT_FOUND, _ERR_FUNCTION_NOT_FOUND, _ERR_NO_DATA}
_NO_GPU_CODES = {_ERR_LIBRARY_NOT_FOUND, _ERR_DRIVER_NOT_LOADED}

_CLOCK_DOMAINS = (("NVML_CLOCK_GRAPHICS", "graphics"), ("NVML_CLOCK_SM", "sm"),
                  ("NVML_CLOCK_MEM", "memory"), ("NVML_CLOCK_VIDEO", "video"))
_REASON_FIELDS = (
    ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP", "sw_power_cap"),
    ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST", "sync_boost"),
    ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", "sw_thermal_slowdown"),
    ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", "hw_thermal_slowdown"),
    ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", "hw_power_brake_slowdown"),
)
#: GPM metric ids → GpuSample/MigSample field (NVML reports 0.0–100.0; we store 0.0–1.0).
_GPM_METRICS = (("NVML_GPM_METRIC_SM_UTIL", "sm_active_ratio"),
                ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm_occupancy_ratio"),
                ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_active_ratio"),
                ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram_bandwidth_ratio"))
#: c_nvmlValue_t member for each NVML_VALUE_TYPE_* (0..6)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _clean(value: Any) -> Any:
    """NVML's "not available" sentinels → None."""
    if isinstance(value, int) and not isinstance(value, bool) and value in _SENTINELS:
        return None
    return value


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value).strip() or None


def _scaled(value: Any, factor: float) -> float | None:
    value = _clean(value)
    return None if value is None else value * factor


class NvmlCollector:
    """Per-GPU and per-MIG readings through NVML.

    Args:
        nvml: the ``pynvml`` module or a stand-in with its API; default imports ``pynvml``.
        bus: where samples, XID events and the status are published (optional).
        clock: supplies ``wall()`` for sample timestamps.
        processes: read per-process memory (one extra NVML call per process).
    """

    def __init__(self, nvml: Any = None, *, bus: StatsBus | None = None,
                 clock: Clock = SYSTEM_CLOCK, processes: bool = True) -> None:
        self._nvml = nvml
        self._bus = bus
        self._clock = clock
        self._processes = processes
        self._handles: list[Any] = []
        self._event_set: Any = None
        self._gpm_prev: dict[tuple[int, int | None], Any] = {}
        self._gpm_supported: dict[int, bool] = {}
        self._started = False
        self.missing_functions: set[str] = set()
        self.status = GpuCollectorStatus(state="not_started")

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        """True once :meth:`start` ran (whatever its outcome)."""
        return self._started

    def start(self) -> GpuCollectorStatus:
        """Initialise NVML, enumerate GPUs, register XID events. Never raises for NVML errors.

        Returns:
            The status (also kept in :attr:`status`): ``ok``, ``no_gpu`` or ``error``.
        """
        self._started = True
        now = self._clock.wall()
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                self.status = GpuCollectorStatus("no_gpu", f"nvidia-ml-py is not installed: {exc}",
                                                 wall_ts=now)
                return self.status
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            state = "no_gpu" if exc.value in _NO_GPU_CODES else "error"
            self.status = GpuCollectorStatus(state, f"nvmlInit failed: {exc}", wall_ts=now)
            log.debug("GPU collector: %s (%s)", state, exc)  # the caller reports the state once
            return self.status
        try:
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nvml.NVMLError as exc:
            self.status = GpuCollectorStatus("error", f"cannot enumerate GPUs: {exc}", wall_ts=now)
            return self.status
        self.status = GpuCollectorStatus(
            "ok" if count else "no_gpu", "" if count else "NVML reports 0 GPUs",
            device_count=count, driver_version=_text(self._call("nvmlSystemGetDriverVersion")),
            wall_ts=now)
        self.status.xid_events_supported = self._register_xid()
        for i, handle in enumerate(self._handles):
            support = self._call("nvmlGpmQueryDeviceSupport", handle)
            self._gpm_supported[i] = bool(support is not None and support.isSupportedDevice)
        return self.status

    def close(self) -> None:
        """Free the event set and GPM samples and shut NVML down (idempotent)."""
        if self.status.state != "ok" or self._nvml is None:
            return
        if self._event_set is not None:
            self._call("nvmlEventSetFree", self._event_set)
            self._event_set = None
        for sample in self._gpm_prev.values():
            self._call("nvmlGpmSampleFree", sample)
        self._gpm_prev.clear()
        self._call("nvmlShutdown")
        self.status = GpuCollectorStatus("closed", wall_ts=self._clock.wall())

    # ------------------------------------------------------------------ reading helpers
    def _call(self, name: str, *args: Any) -> Any:
        """Call ``nvml.<name>(*args)``; unsupported → None; other NVML errors counted → None."""
        fn = getattr(self._nvml, name, None)
        if fn is None:
            self.missing_functions.add(name)
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if exc.value not in _MISSING_CODES:
                key = type(exc).__name__
                self.status.read_errors[key] = self.status.read_errors.get(key, 0) + 1
                log.debug("NVML %s%r failed: %s", name, args, exc)
            return None

    def _const(self, name: str) -> Any:
        return getattr(self._nvml, name)

    def _field_values(self, handle: Any, ids: list[Any]) -> list[Any]:
        """nvmlDeviceGetFieldValues → Python numbers, ``None`` per failed field."""
        raw = self._call("nvmlDeviceGetFieldValues", handle, ids)
        if raw is None:
            return [None] * len(ids)
        out: list[Any] = []  # (raw NVML numbers of the fields' own types)
        for fv in raw:
            if fv.nvmlReturn != 0:
                out.append(None)
                continue
            member = _VALUE_MEMBERS[fv.valueType] if 0 <= fv.valueType < len(_VALUE_MEMBERS) else None
            out.append(_clean(getattr(fv.value, member)) if member else None)
        return out

    def _memory(self, handle: Any) -> tuple[int | None, int | None, int | None, int | None]:
        """(total, used, free, reserved) bytes; v2 struct first (has ``reserved``), then v1."""
        mem = self._call("nvmlDeviceGetMemoryInfo", handle, self._const("nvmlMemory_v2"))
        if mem is not None:
            return (_clean(mem.total), _clean(mem.used), _clean(mem.free), _clean(mem.reserved))
        mem = self._call("nvmlDeviceGetMemoryInfo", handle)
        if mem is None:
            return (None, None, None, None)
        return (_clean(mem.total), _clean(mem.used), _clean(mem.free), None)

    def _gpm(self, key: tuple[int, int | None], take: Callable[[Any], Any]) -> dict[str, float | None]:
        """GPM metrics between the previous and a new sample of ``key`` (device or MIG GI).

        Returns ``{}`` on the first call for a key (GPM needs two samples) or on failure.
        """
        sample = self._call("nvmlGpmSampleAlloc")
        if sample is None or take(sample) is None:
            if sample is not None:
                self._call("nvmlGpmSampleFree", sample)
            return {}
        prev, self._gpm_prev[key] = self._gpm_prev.get(key), sample
        if prev is None:
            return {}
        nvml = self._nvml
        get = nvml.c_nvmlGpmMetricsGet_t()
        get.version = self._const("NVML_GPM_METRICS_GET_VERSION")
        get.numMetrics = len(_GPM_METRICS)
        get.sample1, get.sample2 = prev, sample
        for i, (const, _) in enumerate(_GPM_METRICS):
            get.metrics[i].metricId = self._const(const)
        result = self._call("nvmlGpmMetricsGet", get)
        self._call("nvmlGpmSampleFree", prev)
        if result is None:
            return {}
        out: dict[str, float | None] = {}
        for i, (_, field_name) in enumerate(_GPM_METRICS):
            metric = result.metrics[i]
            out[field_name] = metric.value / 100.0 if metric.nvmlReturn == 0 else None
        return out

    # ------------------------------------------------------------------ collection
    def collect(self) -> list[GpuSample]:
        """Read every GPU once; publish each :class:`GpuSample` and the status on the bus.

        Returns:
            One sample per GPU in NVML index order; ``[]`` when there is no usable GPU.
        """
        if not self._started:
            self.start()
        samples: list[GpuSample] = []
        if self.status.state == "ok":
            now = self._clock.wall()
            samples = [self._read_gpu(i, h, now) for i, h in enumerate(self._handles)]
        self.status.wall_ts = self._clock.wall()
        if self._bus is not None:
            for sample in samples:
                self._bus.publish(sample)
            self._bus.publish(self.status)
        return samples

    def _read_gpu(self, index: int, h: Any, now: float) -> GpuSample:
        call = self._call
        s = GpuSample(wall_ts=now, index=index)
        s.name = _text(call("nvmlDeviceGetName", h))
        s.uuid = _text(call("nvmlDeviceGetUUID", h))
        pci = call("nvmlDeviceGetPciInfo", h)
        s.pci_bus_id = _text(pci.busId) if pci is not None else None
        mig_mode = call("nvmlDeviceGetMigMode", h)
        s.mig_enabled = None if mig_mode is None else bool(mig_mode[0])
        s.memory_total_bytes, s.memory_used_bytes, s.memory_free_bytes, s.memory_reserved_bytes = (
            self._memory(h))
        util = call("nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            s.utilization_gpu_ratio = _scaled(util.gpu, 0.01)
            s.utilization_memory_ratio = _scaled(util.memory, 0.01)
        s.power_watts = _scaled(call("nvmlDeviceGetPowerUsage", h), 1e-3)
        s.power_limit_watts = _scaled(call("nvmlDeviceGetEnforcedPowerLimit", h), 1e-3)
        s.energy_joules = _scaled(call("nvmlDeviceGetTotalEnergyConsumption", h), 1e-3)
        s.temperature_gpu_celsius = _scaled(
            call("nvmlDeviceGetTemperature", h, self._const("NVML_TEMPERATURE_GPU")), 1.0)
        for const, domain in _CLOCK_DOMAINS:
            for fn, target in (("nvmlDeviceGetClockInfo", s.clocks_hz),
                               ("nvmlDeviceGetMaxClockInfo", s.max_clocks_hz)):
                mhz = _clean(call(fn, h, self._const(const)))
                if mhz is not None:
                    target[domain] = mhz * 1e6
        s.clocks_event_reasons = _clean(call("nvmlDeviceGetCurrentClocksEventReasons", h))
        field_ids = [self._const("NVML_FI_DEV_MEMORY_TEMP"),
                     self._const("NVML_FI_DEV_PCIE_REPLAY_COUNTER")]
        field_ids += [self._const(c) for c, _ in _REASON_FIELDS]
        values = self._field_values(h, field_ids)
        s.temperature_memory_celsius = None if values[0] is None else float(values[0])
        s.pcie_replays = values[1]
        for (_, reason), us in zip(_REASON_FIELDS, values[2:], strict=True):
            s.clocks_event_seconds[reason] = None if us is None else us * 1e-6
        s.ecc_corrected_total = _clean(call("nvmlDeviceGetTotalEccErrors", h, self._const(
            "NVML_MEMORY_ERROR_TYPE_CORRECTED"), self._const("NVML_AGGREGATE_ECC")))
        s.ecc_uncorrected_total = _clean(call("nvmlDeviceGetTotalEccErrors", h, self._const(
            "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"), self._const("NVML_AGGREGATE_ECC")))
        rows = call("nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, pending, failure = rows
            s.remapped_rows_correctable, s.remapped_rows_uncorrectable = _clean(corr), _clean(unc)
            s.remapped_rows_pending, s.remapped_rows_failure = bool(pending), bool(failure)
        # NVML reports PCIe throughput in KB/s (1 KB = 1000 B here, as printed by nvidia-smi)
        s.pcie_tx_bytes_per_second = _scaled(
            call("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_TX_BYTES")), 1e3)
        s.pcie_rx_bytes_per_second = _scaled(
            call("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_RX_BYTES")), 1e3)
        self._read_nvlink(h, s)
        if self._gpm_supported.get(index):
            gpm = self._gpm((index, None), lambda smp: call("nvmlGpmSampleGet", h, smp))
            for field_name, value in gpm.items():
                setattr(s, field_name, value)
        if self._processes:
            s.processes = self._read_processes(h)
        if s.mig_enabled:
            s.mig = self._read_migs(index, h, s.processes)
        return s

    def _read_nvlink(self, h: Any, s: GpuSample) -> None:
        nvml = self._nvml
        link_count = self._field_values(h, [self._const("NVML_FI_DEV_NVLINK_LINK_COUNT")])[0]
        active: list[int] = []
        for link in range(link_count if link_count is not None else self._const("NVML_NVLINK_MAX_LINKS")):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(h, link)
            except nvml.NVMLError as exc:
                if link == 0 and exc.value in _MISSING_CODES:
                    return  # NVLink not supported (PCIe card, MIG mode) → None, not 0
                if exc.value != _ERR_INVALID_ARGUMENT:  # INVALID_ARGUMENT: past the last link
                    key = type(exc).__name__
                    self.status.read_errors[key] = self.status.read_errors.get(key, 0) + 1
                break
            if state == self._const("NVML_FEATURE_ENABLED"):
                active.append(link)
        s.nvlink_active_links = len(active)
        if active:
            tx_id = self._const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX")
            rx_id = self._const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX")
            values = self._field_values(h, [(tx_id, ln) for ln in active] + [(rx_id, ln) for ln in active])
            tx, rx = values[:len(active)], values[len(active):]
            # per-link cumulative KiB; a sum over links is only known when every link answered
            s.nvlink_tx_bytes = None if None in tx else sum(tx) * 1024
            s.nvlink_rx_bytes = None if None in rx else sum(rx) * 1024

    def _read_processes(self, h: Any) -> list[GpuProcessSample]:
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", h) or []
        out = []
        for p in procs:
            out.append(GpuProcessSample(
                pid=int(p.pid),
                name=_text(self._call("nvmlSystemGetProcessName", p.pid)),
                used_memory_bytes=_clean(getattr(p, "usedGpuMemory", None)),
                gpu_instance_id=_clean(getattr(p, "gpuInstanceId", None)),
                compute_instance_id=_clean(getattr(p, "computeInstanceId", None)),
            ))
        return out

    def _read_migs(self, index: int, h: Any, processes: list[GpuProcessSample]) -> list[MigSample]:
        call = self._call
        out: list[MigSample] = []
        for mig_index in range(call("nvmlDeviceGetMaxMigDeviceCount", h) or 0):
            mh = call("nvmlDeviceGetMigDeviceHandleByIndex", h, mig_index)
            if mh is None:
                continue  # slot not populated
            m = MigSample(gpu_index=index, mig_index=mig_index)
            m.uuid = _text(call("nvmlDeviceGetUUID", mh))
            name = _text(call("nvmlDeviceGetName", mh))
            m.profile = name.rsplit(" MIG ", 1)[1] if name and " MIG " in name else None
            m.gpu_instance_id = _clean(call("nvmlDeviceGetGpuInstanceId", mh))
            m.compute_instance_id = _clean(call("nvmlDeviceGetComputeInstanceId", mh))
            attrs = call("nvmlDeviceGetAttributes", mh)
            m.sm_count = None if attrs is None else _clean(attrs.multiprocessorCount)
            (m.memory_total_bytes, m.memory_used_bytes, m.memory_free_bytes,
             m.memory_reserved_bytes) = self._memory(mh)
            # the parent handle lists every instance's processes on current drivers; older
            # drivers list them only on the MIG handle, so ask it too and merge by pid
            m.processes = [p for p in processes if p.gpu_instance_id == m.gpu_instance_id
                           and m.gpu_instance_id is not None]
            if self._processes:
                known = {p.pid for p in processes}
                for p in self._read_processes(mh):
                    if p.pid not in known:
                        p.gpu_instance_id = p.gpu_instance_id if p.gpu_instance_id is not None else m.gpu_instance_id
                        m.processes.append(p)
                        processes.append(p)
                        known.add(p.pid)
            if self._gpm_supported.get(index) and m.gpu_instance_id is not None:
                gi: int = m.gpu_instance_id

                def take_mig_sample(smp: Any, gi: int = gi) -> Any:  # binds this GI, not the loop's last
                    return call("nvmlGpmMigSampleGet", h, gi, smp)

                gpm = self._gpm((index, gi), take_mig_sample)
                for field_name, value in gpm.items():
                    setattr(m, field_name, value)
            out.append(m)
        return out

    # ------------------------------------------------------------------ XID events
    def _register_xid(self) -> bool:
        event_set = self._call("nvmlEventSetCreate")
        if event_set is None:
            return False
        xid = self._const("nvmlEventTypeXidCriticalError")
        registered = 0
        for handle in self._handles:
            fn = self._nvml.nvmlDeviceRegisterEvents
            try:
                fn(handle, xid, event_set)
                registered += 1
            except self._nvml.NVMLError as exc:  # e.g. NOT_SUPPORTED on some boards
                log.info("XID events not available on a GPU: %s", exc)
        if not registered:
            self._call("nvmlEventSetFree", event_set)
            return False
        self._event_set = event_set
        return True

    def poll_xid(self, timeout_ms: int = 0, max_events: int = 64) -> list[XidEvent]:
        """Drain XID events, waiting up to ``timeout_ms`` for the first one.

        Returns:
            The events (also published on the bus); ``[]`` without XID support.
        """
        if self._event_set is None:
            return []
        nvml = self._nvml
        events: list[XidEvent] = []
        while len(events) < max_events:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
            except nvml.NVMLError as exc:
                if exc.value != _ERR_TIMEOUT:
                    key = type(exc).__name__
                    self.status.read_errors[key] = self.status.read_errors.get(key, 0) + 1
                break
            timeout_ms = 0  # drain what is queued, then return
            if not data.eventType & self._const("nvmlEventTypeXidCriticalError"):
                continue
            events.append(XidEvent(
                wall_ts=self._clock.wall(),
                gpu_index=self._call("nvmlDeviceGetIndex", data.device),
                xid=int(data.eventData),
                gpu_instance_id=_clean(int(data.gpuInstanceId)),
                compute_instance_id=_clean(int(data.computeInstanceId)),
            ))
        if self._bus is not None:
            for event in events:
                self._bus.publish(event)
        return events
