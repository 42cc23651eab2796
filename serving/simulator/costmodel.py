"""Roofline step-time model and KV capacity of a simulated replica.

One engine iteration (a continuous-batching step) computes ``n_dec`` decode tokens, each attending
to its own context, plus prefill chunks ``(start, length)``. Per GPU of a tensor-parallel group of
``tp`` GPUs (work and weights split evenly; an MLA latent KV replicated):

* FLOPs  ``F = [2·P_active·(n_dec + Σ len) + a·(Σ ctx_dec + Σ (len·start + len·(len+1)/2))] / tp``
  (``a`` = attention FLOPs per context token, :class:`~.models.ModelSpec`);
* bytes  ``B = [W(n) + kv·(Σ ctx_dec + Σ (start + len))] / tp`` — weights read once per step
  (``W(n) = W_total·(1 − (1 − P_active/P_total)ⁿ)``, the expected union of experts touched by n
  tokens; ``W_total`` for a dense model) plus the KV read by decode and by prefill attention and
  written by prefill;
* time   ``t = overhead + max(F / (peak·e_c), B / (bandwidth·e_m))``.

That is the roofline (Williams, Waterman, Patterson, "Roofline", CACM 2009) applied per step: a pure
prefill step is bound by FLOPs over compute throughput, a pure decode step by bytes moved over
memory bandwidth, and a mixed step by whichever dominates. On this *plain* path tensor-parallel
communication is not modelled separately (it lives in the efficiency factors and the overhead).

**Calibrated path.** When the accelerator has an operator calibration (``h100``, ``a100``, and
``h200`` derived from the H100; :mod:`.operators`) and the model has layer shapes, and no
efficiency factor is given explicitly, a step of ``n = n_dec + Σ len`` tokens takes

  ``t = overhead + L·(Σ_GEMMs t_g(n) + Σ_elementwise t_e(n) + 2·t_allreduce(n)) + t_emb(n)
  + t_lm_head(n_dec + #chunks) + max(F_attn / (peak·e_c), B_kv / (bandwidth·e_m))``

— every layer operator's fitted time (GEMMs: a saturating-efficiency roofline; elementwise
kernels: bytes over fitted bandwidth; the two all-reduces per layer when ``tp > 1``), the LM head
for the rows that sample a token (one per decoding request and per prefill chunk: an upper bound,
as a chunk that does not finish its prompt samples nothing), and attention (``F_attn``, ``B_kv``
per GPU as above) on the roofline with the accelerator's default factors: the profiles do not
measure attention kernels, so that term and the per-step overhead remain uncalibrated defaults.

KV capacity per replica (vLLM's profile): per GPU ``memory × utilization − weights/tp − reserve``
bytes, divided by the per-GPU KV bytes of a token (``kv/tp``, or ``kv`` when replicated), rounded
down to whole blocks — or a fixed KV space for CPU engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .hardware import AcceleratorSpec
from .models import ModelSpec
from .operators import OperatorModel

__all__ = ["RooflineCostModel"]


@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    """Step time and KV capacity for ``model`` on ``tp`` × ``accelerator``.

    Args:
        model, accelerator: shapes and spec sheets.
        tp: tensor-parallel degree (≥ 1).
        compute_efficiency, memory_efficiency: fractions of peak reached (0–1]; ``None`` takes
            the accelerator's defaults. Giving either selects the plain roofline (the factors
            then apply to the whole step, as a fit such as :mod:`.calibration` expects).
        step_overhead_s: fixed seconds per step (≥ 0); ``None`` takes the accelerator's default.
        memory_utilization: vLLM ``gpu_memory_utilization`` (0–1]; ``None``: the default.
        block_size: tokens per KV block (vLLM's default 16).
        use_calibration: ``None`` (default): the calibrated operator path when the accelerator
            has a calibration, the model has layer shapes and neither efficiency is given; True:
            require it; False: the plain roofline.
    Raises:
        ValueError: out-of-range factors, weights that do not fit the memory, or
            ``use_calibration=True`` where no calibration applies.
    """

    model: ModelSpec
    accelerator: AcceleratorSpec
    tp: int = 1
    compute_efficiency: float | None = None
    memory_efficiency: float | None = None
    step_overhead_s: float | None = None
    memory_utilization: float | None = None
    block_size: int = 16
    use_calibration: bool | None = None
    _operators: OperatorModel | None = field(default=None, init=False, repr=False, compare=False)
    # the factors above with the accelerator's defaults filled in (set in __post_init__)
    _compute_eff: float = field(default=0.0, init=False, repr=False, compare=False)
    _memory_eff: float = field(default=0.0, init=False, repr=False, compare=False)
    _overhead_s: float = field(default=0.0, init=False, repr=False, compare=False)
    _memory_util: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        acc = self.accelerator
        explicit = self.compute_efficiency is not None or self.memory_efficiency is not None
        if self.tp < 1:
            raise ValueError(f"tp must be ≥ 1, got {self.tp}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        ce = acc.default_compute_efficiency if self.compute_efficiency is None else self.compute_efficiency
        me = acc.default_memory_efficiency if self.memory_efficiency is None else self.memory_efficiency
        mu = acc.default_memory_utilization if self.memory_utilization is None else self.memory_utilization
        overhead = acc.default_step_overhead_s if self.step_overhead_s is None else self.step_overhead_s
        for name, private, v in (("compute_efficiency", "_compute_eff", ce),
                                 ("memory_efficiency", "_memory_eff", me),
                                 ("memory_utilization", "_memory_util", mu),
                                 ("step_overhead_s", "_overhead_s", overhead)):
            object.__setattr__(self, name, v)
            object.__setattr__(self, private, v)
        for name, v in (("compute_efficiency", ce), ("memory_efficiency", me), ("memory_utilization", mu)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if overhead < 0:
            raise ValueError(f"step_overhead_s must be ≥ 0, got {overhead!r}")
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"{self.model.name} does not fit {self.tp}× {acc.name}: weights "
                f"{self.model.weight_bytes / self.tp / 2**30:.1f} GiB per GPU leave no KV space")
        cal = acc.calibration
        applies = cal is not None and self.model.has_layer_shapes
        if self.use_calibration and not applies:
            raise ValueError(f"no GPU calibration applies to {self.model.name} on {acc.name} "
                             "(the accelerator has none, or the model has no layer shapes)")
        # (without a calibration this never holds: use_calibration=True has raised above)
        if cal is not None and (self.use_calibration or (self.use_calibration is None and applies and not explicit)):
            object.__setattr__(self, "_operators", OperatorModel(
                self.model, acc.flops(self.model.compute_dtype), acc.memory_bandwidth_bytes_per_s, self.tp, cal))

    # ------------------------------------------------------------------ capacity
    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        kv = self.model.kv_bytes_per_token
        return kv if self.model.kv_replicated_across_tp else kv / self.tp

    @property
    def kv_bytes_per_gpu(self) -> float:
        """KV space per GPU in bytes (fixed for CPU profiles)."""
        acc = self.accelerator
        if acc.kv_cache_bytes:
            return float(acc.kv_cache_bytes)
        return (acc.memory_bytes * self._memory_util - self.model.weight_bytes / self.tp
                - acc.runtime_reserved_bytes)

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks of the replica (each ``block_size`` tokens)."""
        per_block = self.block_size * self.kv_bytes_per_token_per_gpu
        return max(0, int(self.kv_bytes_per_gpu // per_block))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    # ------------------------------------------------------------------ step time
    @property
    def calibrated(self) -> bool:
        """True when step times come from the calibrated operator terms."""
        return self._operators is not None

    @property
    def operators(self) -> OperatorModel | None:
        """The calibrated operator terms in use, or None on the plain roofline."""
        return self._operators

    @property
    def _compute_rate(self) -> float:
        return self.accelerator.flops(self.model.compute_dtype) * self._compute_eff

    @property
    def _memory_rate(self) -> float:
        return self.accelerator.memory_bandwidth_bytes_per_s * self._memory_eff

    def weight_bytes_read(self, n_tokens: int) -> float:
        """Weight bytes read by a step of ``n_tokens`` tokens, whole replica."""
        m = self.model
        if m.active_params >= m.total_params or n_tokens <= 0:
            return m.weight_bytes if n_tokens > 0 else 0.0
        frac = m.active_params / m.total_params
        return m.weight_bytes * (1.0 - (1.0 - frac) ** n_tokens)

    def step_flops_bytes(self, n_dec: int, ctx_dec_sum: float,
                         chunks: Sequence[tuple[int, int]] = ()) -> tuple[float, float]:
        """(FLOPs, bytes) of one step for the whole replica (not per GPU)."""
        m = self.model
        n_pre = 0
        attn_ctx = float(ctx_dec_sum)
        kv_tokens = float(ctx_dec_sum)
        for start, length in chunks:
            n_pre += length
            attn_ctx += length * start + length * (length + 1) / 2.0
            kv_tokens += start + length
        n = n_dec + n_pre
        flops = m.linear_flops_per_token * n + m.attn_flops_per_ctx_token * attn_ctx
        kv_bytes = m.kv_bytes_per_token * kv_tokens
        if m.kv_replicated_across_tp:
            kv_bytes *= self.tp  # every rank reads the full latent cache
        return flops, self.weight_bytes_read(n) + kv_bytes

    def step_time(self, n_dec: int, ctx_dec_sum: float,
                  chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Seconds for one step: ``n_dec`` decode tokens with summed context ``ctx_dec_sum`` plus
        prefill ``chunks`` of ``(start, length)``. 0.0 for an empty step."""
        if n_dec <= 0 and not chunks:
            return 0.0
        if self._operators is not None:
            n = n_dec + sum(length for _, length in chunks)
            return (self._overhead_s + self._operators.step_time(n, n_dec + len(chunks))
                    + self._attention_time(n_dec, ctx_dec_sum, chunks))
        flops, nbytes = self.step_flops_bytes(n_dec, ctx_dec_sum, chunks)
        return self._overhead_s + max(flops / self.tp / self._compute_rate,
                                          nbytes / self.tp / self._memory_rate)

    def _attention_time(self, n_dec: int, ctx_dec_sum, chunks: Sequence[tuple[int, int]] = ()):
        """Attention of a step on the roofline (calibrated path): QKᵀ/AV FLOPs and the KV bytes
        read and written, per GPU, at the accelerator's default factors. ``ctx_dec_sum`` may be a
        numpy array (one entry per step)."""
        m = self.model
        attn_ctx = ctx_dec_sum + sum(length * start + length * (length + 1) / 2.0 for start, length in chunks)
        kv_tokens = ctx_dec_sum + sum(start + length for start, length in chunks)
        kvb = m.kv_bytes_per_token * (self.tp if m.kv_replicated_across_tp else 1)
        compute = m.attn_flops_per_ctx_token * attn_ctx / self.tp / self._compute_rate
        memory = kvb * kv_tokens / self.tp / self._memory_rate
        return np.maximum(compute, memory) if isinstance(compute, np.ndarray) else max(compute, memory)

    def decode_step_times(self, n_dec: int, ctx_dec_sum: float, k: int) -> np.ndarray:
        """Times of ``k`` consecutive decode-only steps of ``n_dec`` requests whose summed
        context starts at ``ctx_dec_sum`` and grows by ``n_dec`` each step (float64 array)."""
        if k <= 0 or n_dec <= 0:
            return np.zeros(max(k, 0))
        m = self.model
        ctx = ctx_dec_sum + n_dec * np.arange(k, dtype=np.float64)
        if self._operators is not None:
            return self._overhead_s + self._operators.step_time(n_dec, n_dec) + self._attention_time(n_dec, ctx)
        flops = m.linear_flops_per_token * n_dec + m.attn_flops_per_ctx_token * ctx
        kvb = m.kv_bytes_per_token * (self.tp if m.kv_replicated_across_tp else 1)
        nbytes = self.weight_bytes_read(n_dec) + kvb * ctx
        return self._overhead_s + np.maximum(flops / self.tp / self._compute_rate,
                                                 nbytes / self.tp / self._memory_rate)

    def describe(self) -> dict:
        """The model's parameters as plain data (for reports)."""
        return {
            "model": self.model.name, "accelerator": self.accelerator.name, "tp": self.tp,
            "compute_efficiency": self.compute_efficiency, "memory_efficiency": self.memory_efficiency,
            "step_overhead_s": self.step_overhead_s, "memory_utilization": self.memory_utilization,
            "block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks,
            "calibration": self._operators.calibration.basis if self._operators is not None else None,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
        }

    @staticmethod
    def blocks_for(tokens: int, block_size: int) -> int:
        """Blocks holding ``tokens`` tokens."""
        return math.ceil(tokens / block_size) if tokens > 0 else 0
