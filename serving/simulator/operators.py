"""The per-operator step-time terms of a decoder layer, calibrated against measured GPU kernel times.

The calibrated path of :class:`~.costmodel.RooflineCostModel` times the token-count-dependent part
of one engine step operator by operator, per GPU of a tensor-parallel group of ``tp`` GPUs, the way
the Vidur profiles measure it (Agrawal et al., "Vidur", MLSys 2024; ``data/gpu_profiles/vidur``):

* **GEMMs** (per layer: ``attn_pre_proj`` = QKV, ``attn_post_proj`` = output projection,
  ``mlp_up_proj`` = gate+up, ``mlp_down_proj``; per step: the LM head). A GEMM of ``m`` tokens by a
  ``k × n`` weight (per-GPU shard: column-parallel QKV/up split ``n``, row-parallel output/down split
  ``k``) takes ``t = c + max(F / (peak·η(m)), B / (bandwidth·μ))`` with ``F = 2mkn`` FLOPs, ``B =
  2(kn + mk + mn)`` bytes (bf16 weight, input, output) and a compute efficiency that saturates with
  the token count, ``η(m) = η_max · m / (m + m½)`` — the roofline (Williams et al., CACM 2009) with
  an occupancy ramp: few tokens leave most of the GPU's tiles idle. Four fitted numbers per GPU and
  operator: ``η_max``, ``m½`` (tokens at half of it), ``μ`` and the launch time ``c``.
* **Elementwise (streaming) kernels** (per layer: ``input_layernorm``, ``attn_rope``,
  ``post_attention_layernorm``, ``mlp_act``, ``add``; per step: the embedding lookup ``emb``):
  ``t = c + B / (bandwidth·μ)`` with ``B`` the bytes the kernel reads and writes
  (:func:`layer_stream_bytes_per_token`), and ``μ`` replaced by a cached efficiency ``μ_L2`` when
  ``B`` is at most ``B_L2`` bytes — a working set that stays in the L2 cache (50 MB on H100, 40 MB
  on A100) streams faster than HBM; the profiles show the step (e.g. an H100 RMSNorm is 2.6×
  slower from 16 to 32 MB of input). Four fitted numbers per GPU and operator.
* **Tensor-parallel all-reduce** (two per layer when ``tp > 1``: after the output projection and
  after the down projection) of ``S = tokens × hidden × 2`` bytes: ``t = t₀ + 2(n−1)/n · S / B_bus``
  — a ring all-reduce's bus traffic over the bus bandwidth (NCCL's ``busbw`` convention) plus a
  fixed latency. Two fitted numbers per GPU.

The numbers live in ``gpu_calibration.json`` beside this module, written by
:mod:`.calibrate_gpu` (``python -m kvmeter.serving.simulator.calibrate_gpu``), which also reports
the error against the measurements. Efficiencies are fractions of the accelerator's spec-sheet
peaks (:class:`~.hardware.AcceleratorSpec`), so a GPU with the same compute and another memory
system can be derived by applying the same fractions to its own peaks (the H200 from the H100).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

from .models import ModelSpec

__all__ = [
    "GEMM_OPS", "LAYER_STREAM_OPS", "STEP_STREAM_OPS", "POOLED_GEMM", "ACTIVATION_BYTES",
    "gemm_time_s", "stream_time_s", "all_reduce_time_s", "GemmFit", "StreamFit", "AllReduceFit", "GpuCalibration",
    "GemmShape",
    "layer_gemms", "layer_stream_bytes_per_token", "all_reduce_bytes", "OperatorModel",
    "CALIBRATION_PATH", "load_calibrations", "stored_calibrations",
]

#: The per-layer GEMMs, in execution order (Vidur's operator names).
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
#: The per-layer elementwise kernels (Vidur's operator names).
LAYER_STREAM_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
#: Elementwise kernels run once per step, not per layer.
STEP_STREAM_OPS = ("emb",)
#: Key of the GEMM fit pooled over the four layer GEMMs, used for GEMMs without their own (LM head).
POOLED_GEMM = "gemm"
#: Bytes of one activation element (bf16/fp16, what the profiles ran).
ACTIVATION_BYTES = 2

#: Where the fitted parameters live (written by :mod:`.calibrate_gpu`).
CALIBRATION_PATH = Path(__file__).with_name("gpu_calibration.json")


def gemm_time_s(tokens, k, n, peak_flops, bandwidth, weight_bytes, peak_efficiency, half_tokens,
                memory_efficiency, launch_s):
    """Seconds of a ``tokens × k`` by ``k × n`` GEMM: ``c + max(2·m·k·n / (peak·η_max·m/(m+m½)),
    (w·k·n + 2·m·(k+n)) / (bandwidth·μ))``. Every argument may be a numpy array (broadcast);
    ``tokens`` ≥ 1, ``weight_bytes`` = bytes of a weight element (2 for bf16, 1 for fp8)."""
    flops = 2.0 * tokens * k * n
    nbytes = weight_bytes * k * n + ACTIVATION_BYTES * tokens * (k + n)
    eff = peak_efficiency * tokens / (tokens + half_tokens)
    return launch_s + np.maximum(flops / (peak_flops * eff), nbytes / (bandwidth * memory_efficiency))


def stream_time_s(nbytes, bandwidth, memory_efficiency, launch_s, cached_efficiency, cached_bytes):
    """Seconds of an elementwise kernel moving ``nbytes``: ``c + bytes / (bandwidth·μ)``, with
    ``μ_L2`` for ``bytes ≤ B_L2`` (arrays broadcast)."""
    eff = np.where(nbytes <= cached_bytes, cached_efficiency, memory_efficiency)
    return launch_s + nbytes / (bandwidth * eff)


def all_reduce_time_s(nbytes, workers, latency_s, bus_bandwidth):
    """Seconds of a ring all-reduce of ``nbytes`` over ``workers`` GPUs: ``t₀ + 2(n−1)/n · bytes /
    B_bus`` (arrays broadcast)."""
    return latency_s + 2.0 * (workers - 1) / workers * nbytes / bus_bandwidth


@dataclass(frozen=True, slots=True)
class GemmFit:
    """A GEMM's saturating-efficiency roofline (see the module docstring).

    Attributes:
        peak_efficiency: ``η_max``, fraction of peak FLOP/s at many tokens, (0, 1].
        half_tokens: ``m½``, tokens at which the compute efficiency is half of ``η_max`` (≥ 0).
        memory_efficiency: ``μ``, fraction of peak bandwidth when weight-bound, (0, 1].
        launch_s: ``c``, fixed seconds per call (≥ 0).
    """

    peak_efficiency: float
    half_tokens: float
    memory_efficiency: float
    launch_s: float

    def __post_init__(self) -> None:
        if not (0 < self.peak_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ValueError(f"GEMM efficiencies must be in (0, 1]: {self}")
        if self.half_tokens < 0 or self.launch_s < 0:
            raise ValueError(f"GEMM half_tokens and launch_s must be ≥ 0: {self}")

    def time_s(self, tokens, k, n, peak_flops: float, bandwidth: float, weight_bytes: float = 2.0):
        """Seconds of a ``tokens × k`` by ``k × n`` GEMM (see :func:`gemm_time_s`)."""
        return gemm_time_s(tokens, k, n, peak_flops, bandwidth, weight_bytes, self.peak_efficiency,
                           self.half_tokens, self.memory_efficiency, self.launch_s)


@dataclass(frozen=True, slots=True)
class StreamFit:
    """An elementwise kernel bound by memory (see :func:`stream_time_s`).

    Attributes:
        memory_efficiency: ``μ``, fraction of peak HBM bandwidth, (0, 1].
        launch_s: ``c``, fixed seconds per call (≥ 0).
        cached_efficiency: ``μ_L2``, the same fraction for a working set held in L2 (> 0; may
            exceed 1: L2 is faster than HBM).
        cached_bytes: ``B_L2``, the most bytes moved that still run at ``μ_L2`` (≥ 0).
    """

    memory_efficiency: float
    launch_s: float
    cached_efficiency: float
    cached_bytes: float

    def __post_init__(self) -> None:
        if not 0 < self.memory_efficiency <= 1 or self.launch_s < 0 or not self.cached_efficiency > 0 \
                or self.cached_bytes < 0:
            raise ValueError(f"stream fit out of range: {self}")

    def time_s(self, nbytes, bandwidth: float):
        """Seconds to stream ``nbytes`` (see :func:`stream_time_s`)."""
        return stream_time_s(nbytes, bandwidth, self.memory_efficiency, self.launch_s, self.cached_efficiency,
                             self.cached_bytes)


@dataclass(frozen=True, slots=True)
class AllReduceFit:
    """A ring all-reduce: ``t = latency_s + 2(n−1)/n · bytes / bus_bandwidth``.

    Attributes:
        latency_s: fixed seconds per call (≥ 0).
        bus_bandwidth_bytes_per_s: NCCL's bus bandwidth (bytes/s, > 0).
    """

    latency_s: float
    bus_bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bus_bandwidth_bytes_per_s > 0:
            raise ValueError(f"all-reduce fit out of range: {self}")

    def time_s(self, nbytes, workers: int):
        """Seconds to all-reduce ``nbytes`` (scalar or numpy array) over ``workers`` (≥ 2) GPUs."""
        if workers < 2:
            raise ValueError(f"an all-reduce needs ≥ 2 workers, got {workers}")
        return all_reduce_time_s(nbytes, workers, self.latency_s, self.bus_bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True)
class GpuCalibration:
    """One GPU's fitted operator terms.

    Attributes:
        gpu: accelerator name (``h100``, ``a100``, ``h200``).
        basis: how the numbers were obtained (fitted to which measurements, or derived from what).
        gemm: fits by GEMM operator name, plus :data:`POOLED_GEMM`.
        stream: fits by elementwise operator name.
        all_reduce: the all-reduce fit, or None when the GPU has none (no TP communication term).
        all_reduce_basis: how the all-reduce numbers were obtained.
    """

    gpu: str
    basis: str
    gemm: Mapping[str, GemmFit]
    stream: Mapping[str, StreamFit]
    all_reduce: AllReduceFit | None
    all_reduce_basis: str = ""

    def __post_init__(self) -> None:
        missing = [op for op in (*GEMM_OPS, POOLED_GEMM) if op not in self.gemm]
        missing += [op for op in (*LAYER_STREAM_OPS, *STEP_STREAM_OPS) if op not in self.stream]
        if missing:
            raise ValueError(f"{self.gpu}: calibration lacks {', '.join(missing)}")

    def gemm_fit(self, op: str) -> GemmFit:
        """The fit of GEMM ``op``, else the pooled GEMM fit."""
        return self.gemm.get(op) or self.gemm[POOLED_GEMM]


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One GEMM's weight shard on one GPU: ``k`` inputs × ``n`` outputs."""

    name: str
    k: int
    n: int


def layer_gemms(model: ModelSpec, tp: int) -> tuple[GemmShape, ...]:
    """The four GEMMs of one decoder layer of ``model``, sharded over ``tp`` GPUs (Megatron-style:
    QKV and gate+up split by output columns, output and down projections by input rows; KV heads
    replicated when ``tp`` exceeds their count, as vLLM does).

    Raises:
        ValueError: the model has no layer shapes (``hidden_size`` unknown), or its heads or MLP
            width do not split over ``tp`` (vLLM refuses those too).
    """
    q, kv = _heads_per_gpu(model, tp)
    h, d = model.hidden_size, model.head_dim
    if model.intermediate_size % tp:
        raise ValueError(f"{model.name}: MLP width {model.intermediate_size} does not divide by tp={tp}")
    inter = model.intermediate_size // tp
    return (GemmShape("attn_pre_proj", h, (q + 2 * kv) * d),
            GemmShape("attn_post_proj", q * d, h),
            GemmShape("mlp_up_proj", h, (2 if model.gated_mlp else 1) * inter),
            GemmShape("mlp_down_proj", inter, h))


def layer_stream_bytes_per_token(model: ModelSpec, tp: int) -> dict[str, float]:
    """Bytes each elementwise kernel reads and writes per token on one GPU (bf16 activations).

    RMSNorm reads and writes the hidden state (``2h``); RoPE rotates the query and key heads of the
    shard in place (``2(q + kv)·d`` with the shard's head counts); the gated activation reads gate
    and up and writes their product (``3·I / tp``); the residual add reads two hidden states and
    writes one (``3h``); the embedding lookup reads a row and writes the hidden state (``2h``).
    Times :data:`ACTIVATION_BYTES`.
    """
    q, kv = _heads_per_gpu(model, tp)
    h, d, b = model.hidden_size, model.head_dim, ACTIVATION_BYTES
    return {
        "input_layernorm": 2.0 * h * b,
        "attn_rope": 2.0 * (q + kv) * d * b,
        "post_attention_layernorm": 2.0 * h * b,
        "mlp_act": (3.0 if model.gated_mlp else 2.0) * model.intermediate_size / tp * b,
        "add": 3.0 * h * b,
        "emb": 2.0 * h * b,
    }


def all_reduce_bytes(model: ModelSpec, tokens) -> float:
    """Bytes of one tensor-parallel all-reduce of ``tokens`` hidden states (``tokens × h × 2``)."""
    _require_shapes(model)
    return tokens * model.hidden_size * ACTIVATION_BYTES


class OperatorModel:
    """The calibrated, token-count-dependent part of one step of ``model`` on ``tp`` GPUs.

    Args:
        model: a shape with ``hidden_size`` (dense GQA/MHA decoder).
        peak_flops: dense peak FLOP/s of one GPU in the model's compute dtype.
        bandwidth: peak memory bandwidth of one GPU (bytes/s).
        tp: tensor-parallel degree (≥ 1).
        calibration: the GPU's fitted terms.
    Raises:
        ValueError: the model has no layer shapes, a dimension does not divide by ``tp``, or
            ``tp > 1`` on a calibration without an all-reduce fit.
    """

    def __init__(self, model: ModelSpec, peak_flops: float, bandwidth: float, tp: int,
                 calibration: GpuCalibration) -> None:
        if tp < 1:
            raise ValueError(f"tp must be ≥ 1, got {tp}")
        if tp > 1 and calibration.all_reduce is None:
            raise ValueError(f"{calibration.gpu}: no all-reduce calibration for tp={tp}")
        self.model, self.tp, self.calibration = model, tp, calibration
        # the all-reduce term, present exactly when tp > 1 (checked above)
        self._all_reduce: AllReduceFit | None = calibration.all_reduce if tp > 1 else None
        self.peak_flops, self.bandwidth = float(peak_flops), float(bandwidth)
        self._gemms = layer_gemms(model, tp)
        self._stream = layer_stream_bytes_per_token(model, tp)
        self._lm_head = GemmShape("lm_head", model.hidden_size, _ceil_div(model.vocab_size, tp))
        self._body_cache: dict[int, float] = {}   # tokens → layers + embedding, seconds
        self._head_cache: dict[int, float] = {}   # sampled rows → LM head, seconds

    def operator_times(self, tokens: int) -> dict[str, float]:
        """Seconds of each operator for a batch of ``tokens`` (≥ 1) tokens on one GPU, by Vidur's
        operator name: the layer's GEMMs and elementwise kernels (once per layer), ``all_reduce``
        (present when ``tp > 1``: *one* of the layer's two) and ``emb`` (once per step)."""
        cal, wb = self.calibration, self.model.weight_bytes_per_param
        out = {g.name: float(cal.gemm_fit(g.name).time_s(tokens, g.k, g.n, self.peak_flops, self.bandwidth, wb))
               for g in self._gemms}
        for op in (*LAYER_STREAM_OPS, *STEP_STREAM_OPS):
            out[op] = float(cal.stream[op].time_s(self._stream[op] * tokens, self.bandwidth))
        if self._all_reduce is not None:
            out["all_reduce"] = float(self._all_reduce.time_s(all_reduce_bytes(self.model, tokens), self.tp))
        return out

    def step_time(self, tokens: int, logits: int) -> float:
        """Seconds of every layer's operators, the embedding lookup and the LM head for a step of
        ``tokens`` tokens of which ``logits`` rows are sampled (0.0 for no tokens). Attention
        (the QKᵀ/AV kernels) and the per-step overhead are not included."""
        if tokens <= 0:
            return 0.0
        body = self._body_cache.get(tokens)
        if body is None:
            ops = self.operator_times(tokens)
            per_step = sum(ops.pop(op) for op in STEP_STREAM_OPS)
            ar = ops.pop("all_reduce", 0.0)
            body = self.model.num_layers * (sum(ops.values()) + 2.0 * ar) + per_step
            if len(self._body_cache) < 65_536:
                self._body_cache[tokens] = body
        if logits <= 0:
            return body
        head = self._head_cache.get(logits)
        if head is None:
            g = self._lm_head
            head = float(self.calibration.gemm_fit(g.name).time_s(
                logits, g.k, g.n, self.peak_flops, self.bandwidth, self.model.weight_bytes_per_param))
            if len(self._head_cache) < 65_536:
                self._head_cache[logits] = head
        return body + head

def load_calibrations(path: Path = CALIBRATION_PATH) -> dict[str, GpuCalibration]:
    """The calibrations in ``path`` by GPU name (the file :mod:`.calibrate_gpu` writes).

    Raises:
        ValueError: a malformed file (missing keys, out-of-range values).
        OSError: the file cannot be read.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out: dict[str, GpuCalibration] = {}
    try:
        for gpu, entry in data["gpus"].items():
            ar = entry.get("all_reduce")
            out[gpu] = GpuCalibration(
                gpu=gpu, basis=entry["basis"],
                gemm=MappingProxyType({op: GemmFit(**v) for op, v in entry["gemm"].items()}),
                stream=MappingProxyType({op: StreamFit(**v) for op, v in entry["stream"].items()}),
                all_reduce=AllReduceFit(**{k: v for k, v in ar.items() if k != "basis"}) if ar else None,
                all_reduce_basis=ar.get("basis", "") if ar else "")
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: malformed GPU calibration ({err!r})") from None
    return out


@functools.cache
def stored_calibrations() -> Mapping[str, GpuCalibration]:
    """The calibrations shipped in :data:`CALIBRATION_PATH`, loaded once (read-only mapping)."""
    return MappingProxyType(load_calibrations(CALIBRATION_PATH))


# ---------------------------------------------------------------------------------------- helpers
def _require_shapes(model: ModelSpec) -> None:
    if not model.has_layer_shapes:
        raise ValueError(f"{model.name}: no layer shapes (hidden_size, intermediate_size, vocab_size)")


def _heads_per_gpu(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one GPU of ``tp``: queries split, KV heads split or replicated."""
    _require_shapes(model)
    q, kv = model.num_q_heads, model.num_kv_heads
    if q % tp or (kv % tp and tp % kv):
        raise ValueError(f"{model.name}: {q} query / {kv} KV heads do not split over tp={tp}")
    return q // tp, max(1, kv // tp)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

