"""A stand-in for the ``pynvml`` module, answering from a real nvidia-smi capture.

No NVIDIA GPU exists on the machines that build and test kvmeter, so the NVML collector is driven
through this object in tests and benchmarks. It implements the ``pynvml`` functions
:class:`~kvmeter.collectors.gpu.nvml_collector.NvmlCollector` calls, with the same names,
arguments and return shapes (the real ``pynvml`` ctypes structures where pynvml returns one), and
raises the real ``pynvml.NVMLError`` subclasses. Constants and exception classes are pynvml's own.

What the capture does not hold is *not supported* here, exactly as on a device that lacks it:

* ``[N/A]`` values raise ``NVMLError_NotSupported`` (e.g. utilisation under MIG, remapped rows
  on the MIG capture) or, inside ``nvmlDeviceGetFieldValues``, carry
  ``nvmlReturn = NVML_ERROR_NOT_SUPPORTED``;
* energy, NVLink throughput counters and GPM metrics are in none of the captures, so
  ``nvmlDeviceGetTotalEnergyConsumption`` raises NotSupported, the NVLink throughput fields are
  NotSupported and ``nvmlGpmQueryDeviceSupport`` reports ``isSupportedDevice = 0``;
* XID events: none were captured, so ``nvmlEventSetWait`` times out — unless a test calls
  :meth:`CaptureNvml.inject_xid` (a synthetic event, for the event path only).

A function the stand-in does not implement raises ``AttributeError`` naming it, so a collector
change that calls new NVML API fails loudly here instead of silently reading nothing.
"""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pynvml

from .capture import CapturedGpu, CapturedMig, CapturedSystem, load_capture

__all__ = ["CaptureNvml", "MIB"]

MIB = 1024 * 1024

#: Most MIG devices one A100/H100/H200 can hold (NVIDIA MIG user guide: up to seven instances).
MAX_MIG_DEVICES = 7

_CLOCKS = {
    pynvml.NVML_CLOCK_GRAPHICS: "graphics",
    pynvml.NVML_CLOCK_SM: "sm",
    pynvml.NVML_CLOCK_MEM: "memory",
    pynvml.NVML_CLOCK_VIDEO: "video",
}
_REASON_BITS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
_REASON_FIELDS = {
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: "sw_power_cap",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: "sync_boost",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: "sw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: "hw_thermal_slowdown",
    pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
}
_NO_INSTANCE = 0xFFFFFFFF  # what NVML puts in gpuInstanceId/computeInstanceId outside MIG


@dataclass(frozen=True, slots=True)
class _Handle:
    gpu: int
    mig: int | None = None


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.freed = False


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _need(value):
    if value is None:
        raise _not_supported()
    return value


class CaptureNvml:
    """pynvml-compatible answers from one :class:`CapturedSystem`.

    Args:
        system: a parsed capture (see :func:`~kvmeter.collectors.gpu.capture.load_capture`).
    """

    def __init__(self, system: CapturedSystem) -> None:
        self.system = system
        self._initialised = 0
        self._pending_events: deque[tuple[int, int, int, int]] = deque()
        self.calls: dict[str, int] = {}

    @classmethod
    def from_file(cls, path: str | Path, phase: str = "load") -> "CaptureNvml":
        """Load ``path`` (a ``.txt`` capture's ``idle``/``load`` phase, or ``-q -x`` XML)."""
        return cls(load_capture(path, phase))

    # pynvml constants and exception classes pass through; unimplemented functions do not
    def __getattr__(self, name: str):
        value = getattr(pynvml, name)
        if isinstance(value, types.FunctionType) and name.startswith("nvml"):
            raise AttributeError(f"CaptureNvml does not implement pynvml.{name}")
        return value

    # ---- helpers
    def _count(self, name: str) -> None:
        if not self._initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: _Handle) -> CapturedGpu:
        if not isinstance(handle, _Handle) or handle.gpu >= len(self.system.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.system.gpus[handle.gpu]

    def _mig(self, handle: _Handle) -> CapturedMig | None:
        gpu = self._gpu(handle)
        if handle.mig is None:
            return None
        return next(m for m in gpu.migs if m.index == handle.mig)

    # ---- library
    def nvmlInit(self) -> None:
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        if not self._initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self._initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._count("nvmlSystemGetDriverVersion")
        return _need(self.system.driver_version)

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._count("nvmlSystemGetProcessName")
        for gpu in self.system.gpus:
            for proc in gpu.processes:
                if proc.pid == pid and proc.name is not None:
                    return proc.name
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # ---- enumeration
    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        return len(self.system.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._count("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.system.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._count("nvmlDeviceGetName")
        gpu, mig = self._gpu(handle), self._mig(handle)
        name = _need(gpu.name)
        if mig is not None:  # NVML names a MIG device "<GPU name> MIG <profile>"
            return f"{name} MIG {_need(mig.profile)}"
        return name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._count("nvmlDeviceGetUUID")
        mig = self._mig(handle)
        return _need(mig.uuid if mig is not None else self._gpu(handle).uuid)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> pynvml.nvmlPciInfo_t:
        self._count("nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = _need(self._gpu(handle).pci_bus_id).encode()
        return info

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._count("nvmlDeviceGetMigMode")
        gpu = self._gpu(handle)
        if gpu.mig_current is None:
            raise _not_supported()
        return [int(gpu.mig_current), int(bool(gpu.mig_pending))]

    # ---- memory and utilisation
    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version=None):
        self._count("nvmlDeviceGetMemoryInfo")
        src = self._mig(handle) or self._gpu(handle)
        total, used, free = src.memory_total_mib, src.memory_used_mib, src.memory_free_mib
        if total is None or used is None or free is None:
            raise _not_supported()
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = (src.memory_reserved_mib or 0) * MIB
        else:
            mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total * MIB, used * MIB, free * MIB
        return mem

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle):
        self._count("nvmlDeviceGetUtilizationRates")
        if handle.mig is not None:
            raise _not_supported()
        gpu = self._gpu(handle)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = int(_need(gpu.utilization_gpu_pct))
        util.memory = int(_need(gpu.utilization_memory_pct))
        return util

    # ---- power, energy, temperature, clocks
    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetPowerUsage")
        return round(_need(self._gpu(handle).power_draw_w) * 1000)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetEnforcedPowerLimit")
        return round(_need(self._gpu(handle).power_limit_w) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetTotalEnergyConsumption")
        raise _not_supported()  # nvidia-smi -q does not print the energy counter

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        self._count("nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(_need(self._gpu(handle).temperature_gpu_c))

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        self._count("nvmlDeviceGetClockInfo")
        return int(_need(self._gpu(handle).clocks_mhz.get(_CLOCKS.get(clock_type, ""))))

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, clock_type: int) -> int:
        self._count("nvmlDeviceGetMaxClockInfo")
        return int(_need(self._gpu(handle).max_clocks_mhz.get(_CLOCKS.get(clock_type, ""))))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetCurrentClocksEventReasons")
        reasons = self._gpu(handle).clock_event_reasons
        if not reasons or any(v is None for v in reasons.values()):
            raise _not_supported()
        return sum(_REASON_BITS[name] for name, active in reasons.items() if active)

    def nvmlDeviceGetFieldValues(self, handle: _Handle, field_ids):
        self._count("nvmlDeviceGetFieldValues")
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            value = values[i]
            value.fieldId, value.scopeId = fid, scope
            reading: float | None = None
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                reading = gpu.temperature_memory_c
            elif fid == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
                reading = gpu.pcie_replays
            elif fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and gpu.nvlink_link_gb_s is not None:
                reading = len(gpu.nvlink_link_gb_s)
            elif fid in _REASON_FIELDS:
                reading = gpu.clock_event_counters_us.get(_REASON_FIELDS[fid])
            # NVLink throughput counters and anything else: not in any capture
            if reading is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = int(reading)
        return values

    # ---- errors and health
    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        self._count("nvmlDeviceGetTotalEccErrors")
        kind = "corrected" if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
        scope = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        return int(_need(self._gpu(handle).ecc_errors.get((kind, scope))))

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        self._count("nvmlDeviceGetRemappedRows")
        rows = _need(self._gpu(handle).remapped_rows)
        if any(v is None for v in rows):
            raise _not_supported()
        corr, unc, pending, failure = rows
        return (corr, unc, int(pending), int(failure))

    # ---- interconnect
    def nvmlDeviceGetPcieThroughput(self, handle: _Handle, counter: int) -> int:
        self._count("nvmlDeviceGetPcieThroughput")
        gpu = self._gpu(handle)
        value = gpu.pcie_tx_kb_s if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else gpu.pcie_rx_kb_s
        return int(_need(value))  # KB/s, as NVML returns it

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        self._count("nvmlDeviceGetNvLinkState")
        links = self._gpu(handle).nvlink_link_gb_s
        if links is None:
            raise _not_supported()
        if link >= len(links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    # ---- processes
    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list:
        self._count("nvmlDeviceGetComputeRunningProcesses")
        gpu, mig = self._gpu(handle), self._mig(handle)
        out = []
        for proc in gpu.processes:
            if mig is not None and proc.gpu_instance_id != mig.gpu_instance_id:
                continue
            out.append(pynvml.nvmlFriendlyObject({
                "pid": proc.pid,
                "usedGpuMemory": None if proc.used_memory_mib is None else proc.used_memory_mib * MIB,
                "gpuInstanceId": _NO_INSTANCE if proc.gpu_instance_id is None else proc.gpu_instance_id,
                "computeInstanceId": (_NO_INSTANCE if proc.compute_instance_id is None
                                      else proc.compute_instance_id),
            }))
        return out

    # ---- MIG
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetMaxMigDeviceCount")
        gpu = self._gpu(handle)
        if gpu.mig_current is None:
            raise _not_supported()
        return MAX_MIG_DEVICES if gpu.mig_current else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._count("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._gpu(handle)
        if not any(m.index == index for m in gpu.migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(handle.gpu, index)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetGpuInstanceId")
        mig = self._mig(handle)
        if mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _need(mig.gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetComputeInstanceId")
        mig = self._mig(handle)
        if mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _need(mig.compute_instance_id)

    def nvmlDeviceGetAttributes(self, handle: _Handle):
        self._count("nvmlDeviceGetAttributes")
        mig = self._mig(handle)
        if mig is None:
            raise _not_supported()
        attrs = pynvml.c_nvmlDeviceAttributes()
        attrs.multiprocessorCount = _need(mig.sm_count)
        attrs.memorySizeMB = _need(mig.memory_total_mib)
        return attrs

    # ---- GPM (GPU performance monitoring): absent from every capture
    def nvmlGpmQueryDeviceSupport(self, handle: _Handle):
        self._count("nvmlGpmQueryDeviceSupport")
        self._gpu(handle)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 0
        return support

    # ---- events
    def nvmlEventSetCreate(self) -> _EventSet:
        self._count("nvmlEventSetCreate")
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: _EventSet) -> None:
        self._count("nvmlDeviceRegisterEvents")
        self._gpu(handle)
        event_set.registered[handle.gpu] = event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int):
        self._count("nvmlEventSetWait_v2")
        while self._pending_events:
            gpu, xid, gi, ci = self._pending_events.popleft()
            if event_set.registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError:
                # the fields of pynvml's c_nvmlEventData_t, with the stand-in's handle as device
                return pynvml.nvmlFriendlyObject({
                    "device": _Handle(gpu), "eventType": pynvml.nvmlEventTypeXidCriticalError,
                    "eventData": xid, "gpuInstanceId": gi, "computeInstanceId": ci})
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int):
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._count("nvmlEventSetFree")
        event_set.freed = True

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._count("nvmlDeviceGetIndex")
        return self._gpu(handle).index

    # ---- test hook (synthetic; no XID appears in any capture)
    def inject_xid(self, gpu_index: int, xid: int, gpu_instance_id: int = _NO_INSTANCE,
                   compute_instance_id: int = _NO_INSTANCE) -> None:
        """Queue one synthetic XID event for ``nvmlEventSetWait`` to return (tests only)."""
        self._pending_events.append((gpu_index, xid, gpu_instance_id, compute_instance_id))
