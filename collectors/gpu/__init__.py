"""GPU readings through NVML: memory, utilisation, GPM activity, power, energy, temperature,
clocks and their event reasons, XID errors, ECC and remapped rows, PCIe/NVLink, per-process
memory, per-MIG-instance memory and activity.

``NvmlCollector`` reads the real ``pynvml`` (nvidia-ml-py) on a GPU machine, or the
capture-backed ``CaptureNvml`` stand-in on machines without one; ``GpuPoller`` runs it on a thread.
Samples are the plain dataclasses of :mod:`kvmeter.stats.gpu`, published on a ``kvmeter.bus.StatsBus``.
"""

from .capture import CaptureFormatError, CapturedSystem, load_capture
from .capture_nvml import CaptureNvml
from .dcgm import DcgmParseError, gpu_samples_from_dcgm
from .nvml_collector import NvmlCollector
from .poller import GpuPoller

__all__ = [
    "NvmlCollector",
    "GpuPoller",
    "CaptureNvml",
    "load_capture",
    "CapturedSystem",
    "CaptureFormatError",
    "gpu_samples_from_dcgm",
    "DcgmParseError",
]
