"""Stats of the GPUs, as the NVML collector (or the DCGM reader) publishes them.

Every reading NVML cannot give — ``[N/A]`` in nvidia-smi, ``NVML_ERROR_NOT_SUPPORTED``, the
"value not available" sentinels (``0xFFFFFFFF`` / ``0xFFFFFFFFFFFFFFFF``), DCGM's blank values — is
``None``, never 0: a 0 % utilisation and an unknown utilisation are different facts.

Units are in the field names and are SI base units (bytes, watts, joules, hertz, seconds, ratios
0.0–1.0) so the exporters need no conversion. Timestamps are wall-clock Unix epoch seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "GpuProcessSample",
    "MigSample",
    "GpuSample",
    "XidEvent",
    "GpuCollectorStatus",
    "CLOCK_EVENT_REASONS",
    "clock_event_reason_names",
]

#: NVML clocks-event reason bits (``nvmlClocksEventReason*`` in nvml.h) → kvmeter's reason label.
#: Why the clock is below its maximum; "idle" and "applications_clocks_setting" are benign.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def clock_event_reason_names(mask: int | None) -> tuple[str, ...] | None:
    """Names of the reasons set in an ``nvmlDeviceGetCurrentClocksEventReasons`` bit mask.

    Returns ``None`` for an unknown mask; unknown bits are named ``bit_0x...``.
    """
    if mask is None:
        return None
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    known = sum(CLOCK_EVENT_REASONS)
    for bit in range(64):
        if mask & (1 << bit) and not known & (1 << bit):
            names.append(f"bit_{1 << bit:#x}")
    return tuple(names)


@dataclass(slots=True)
class GpuProcessSample:
    """One process holding GPU memory (``nvmlDeviceGetComputeRunningProcesses``).

    Attributes:
        pid: host process id.
        name: executable path or name (``None`` if NVML cannot read it).
        used_memory_bytes: device memory the process holds; ``None`` when NVML reports "not
            available" (e.g. under some virtualisation). Per-process sums are below the device's
            ``memory_used_bytes``: the driver's own allocations belong to no process.
        gpu_instance_id, compute_instance_id: MIG instance the process runs in (``None`` outside MIG).
    """

    pid: int
    name: str | None = None
    used_memory_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(slots=True)
class MigSample:
    """One MIG device (a GPU instance + compute instance) of a MIG-enabled GPU.

    Attributes:
        gpu_index: parent GPU index; mig_index: NVML's MIG device index on that GPU.
        uuid: the ``MIG-...`` UUID; profile: e.g. ``3g.40gb`` (``None`` if unknown).
        gpu_instance_id, compute_instance_id: NVML GI / CI ids.
        sm_count: streaming multiprocessors in this instance.
        memory_*_bytes: the instance's share of device memory (used + free + reserved ≈ total;
            nvidia-smi rounds each to MiB, so the sum may be off by 1 MiB).
        sm_active_ratio, sm_occupancy_ratio, tensor_active_ratio, dram_bandwidth_ratio: GPM
            metrics for this GPU instance (0.0–1.0), ``None`` without GPM support or before the
            second sample.
        processes: processes running in this GPU instance.
    """

    gpu_index: int
    mig_index: int
    uuid: str | None = None
    profile: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    sm_count: int | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_bandwidth_ratio: float | None = None
    processes: list[GpuProcessSample] = field(default_factory=list)


@dataclass(slots=True)
class GpuSample:
    """One physical GPU at one instant.

    Attributes:
        wall_ts: wall-clock epoch seconds of the reading.
        index, uuid, name, pci_bus_id: identity (NVML index order).
        mig_enabled: current MIG mode (``None`` if the GPU has no MIG support).
        memory_total_bytes, memory_used_bytes, memory_free_bytes, memory_reserved_bytes: device
            memory (``nvmlDeviceGetMemoryInfo`` v2; reserved = driver/firmware reservation).
        utilization_gpu_ratio: **coarse** — the fraction of the last sample period (1/6 s to 1 s)
            during which *any* kernel ran on the GPU, not how many SMs it used; a single tiny
            kernel reads as 1.0. ``None`` in MIG mode (NVML does not report it). Use
            ``sm_active_ratio`` for real load.
        utilization_memory_ratio: fraction of time device memory was read or written (coarse too).
        sm_active_ratio: GPM ``SM_UTIL`` — fraction of SMs busy, averaged over the interval between
            two collections (0.0–1.0); ``None`` without GPM (pre-Hopper, or first sample).
        sm_occupancy_ratio: GPM ``SM_OCCUPANCY`` — resident warps / theoretical maximum.
        tensor_active_ratio: GPM ``ANY_TENSOR_UTIL`` — fraction of time tensor cores were busy.
        dram_bandwidth_ratio: GPM ``DRAM_BW_UTIL`` — DRAM bandwidth used / peak. Decode is
            memory-bandwidth-bound, so this, not utilisation, shows decode pressure.
        power_watts: average board power draw; power_limit_watts: enforced limit.
        energy_joules: energy since the driver loaded (``nvmlDeviceGetTotalEnergyConsumption``,
            mJ → J); a cumulative counter that restarts at driver reload.
        temperature_gpu_celsius, temperature_memory_celsius: die and HBM temperatures.
        clocks_hz: current clocks by domain (``graphics``, ``sm``, ``memory``, ``video``);
            max_clocks_hz: their maxima. A domain NVML cannot read is absent.
        clocks_event_reasons: raw ``nvmlDeviceGetCurrentClocksEventReasons`` bit mask
            (``CLOCK_EVENT_REASONS`` names the bits); ``None`` if unknown.
        clocks_event_seconds: cumulative time (since driver load) the clock was held down, by
            reason (``sw_power_cap``, ``sync_boost``, ``sw_thermal_slowdown``,
            ``hw_thermal_slowdown``, ``hw_power_brake_slowdown``); value ``None`` if unknown.
        ecc_corrected_total, ecc_uncorrected_total: aggregate (lifetime) ECC error counts.
        remapped_rows_correctable, remapped_rows_uncorrectable: rows remapped after errors;
            remapped_rows_pending: a remap waits for a GPU reset; remapped_rows_failure: remapping
            failed (the GPU needs service).
        pcie_tx_bytes_per_second, pcie_rx_bytes_per_second: PCIe throughput over NVML's 20 ms
            sample window.
        pcie_replays: PCIe replay counter (cumulative).
        nvlink_active_links: links up (``None`` where NVLink queries are unsupported, e.g. MIG).
        nvlink_tx_bytes, nvlink_rx_bytes: cumulative NVLink data bytes (all links).
        processes: processes holding memory on this GPU.
        mig: MIG devices when MIG is enabled.
    """

    wall_ts: float
    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    mig_enabled: bool | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_bandwidth_ratio: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    temperature_gpu_celsius: float | None = None
    temperature_memory_celsius: float | None = None
    clocks_hz: dict[str, float] = field(default_factory=dict)
    max_clocks_hz: dict[str, float] = field(default_factory=dict)
    clocks_event_reasons: int | None = None
    clocks_event_seconds: dict[str, float | None] = field(default_factory=dict)
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_replays: int | None = None
    nvlink_active_links: int | None = None
    nvlink_tx_bytes: int | None = None
    nvlink_rx_bytes: int | None = None
    processes: list[GpuProcessSample] = field(default_factory=list)
    mig: list[MigSample] = field(default_factory=list)

    @property
    def active_clock_event_reasons(self) -> tuple[str, ...] | None:
        """Names of the reasons currently holding the clock down (``None`` if unknown)."""
        return clock_event_reason_names(self.clocks_event_reasons)


@dataclass(slots=True)
class XidEvent:
    """One XID error reported by the driver (``nvmlEventTypeXidCriticalError``).

    Attributes:
        wall_ts: wall-clock epoch seconds when kvmeter received it.
        gpu_index: GPU that raised it (``None`` if the handle could not be matched).
        xid: the XID code (e.g. 48 double-bit ECC, 79 GPU fell off the bus, 94/95 contained /
            uncontained ECC); see NVIDIA's "XID Errors" catalogue.
        gpu_instance_id, compute_instance_id: MIG instance, ``None`` outside MIG.
    """

    wall_ts: float
    gpu_index: int | None
    xid: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(slots=True)
class GpuCollectorStatus:
    """Whether NVML is usable, published with every collection.

    Attributes:
        state: ``ok`` (NVML initialised, ``device_count`` GPUs), ``no_gpu`` (no NVIDIA driver or
            library on this machine — everything else keeps working) or ``error`` (NVML present
            but failing; see ``reason``).
        reason: human-readable cause for ``no_gpu`` / ``error``.
        device_count: GPUs NVML reported (0 unless ``ok``).
        driver_version: e.g. ``590.48.01``.
        read_errors: per NVML error name, how many reads failed with it since start (reads that
            returned "not supported" are not errors and are not counted).
        xid_events_supported: whether XID events could be registered.
        wall_ts: wall-clock epoch seconds.
    """

    state: str
    reason: str = ""
    device_count: int = 0
    driver_version: str | None = None
    read_errors: dict[str, int] = field(default_factory=dict)
    xid_events_supported: bool = False
    wall_ts: float = 0.0
