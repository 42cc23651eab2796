"""GPU signals through NVML: memory, utilisation, GPM activity, power, energy, temperature,
clocks and their event reasons, XID errors, ECC and remapped rows, PCIe/NVLink, per-process
memory, per-MIG-instance memory and activity.

``NvmlCollector`` reads the real ``pynvml`` (nvidia-ml-py) on a GPU machine, or the
capture-backed ``CaptureNvml`` stand-in on machines without one; ``GpuPoller`` runs it on a thread.
Samples are plain dataclasses published on a ``kvmeter.bus.StatsBus``.
"""

from .capture import CaptureFormatError, CapturedSystem, load_capture
from .capture_nvml import CaptureNvml
from .dcgm import DcgmParseError, gpu_samples_from_dcgm
from .nvml_collector import NvmlCollector
from .poller import GpuPoller
from .samples import (
    CLOCK_EVENT_REASONS,
    GpuCollectorStatus,
    GpuProcessSample,
    GpuSample,
    MigSample,
    XidEvent,
    clock_event_reason_names,
)

__all__ = [
    "NvmlCollector",
    "GpuPoller",
    "CaptureNvml",
    "load_capture",
    "CapturedSystem",
    "CaptureFormatError",
    "gpu_samples_from_dcgm",
    "DcgmParseError",
    "GpuSample",
    "MigSample",
    "GpuProcessSample",
    "XidEvent",
    "GpuCollectorStatus",
    "CLOCK_EVENT_REASONS",
    "clock_event_reason_names",
]
