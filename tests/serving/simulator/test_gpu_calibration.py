"""The GPU operator calibration against the measured Vidur profiles (data/gpu_profiles/vidur).

Every prediction here goes through the cost model's own code (:class:`OperatorModel`, the
``RooflineCostModel`` the simulator builds) with the parameters stored in
``serving/simulator/gpu_calibration.json``, so a change to the formulas, the stored numbers or the
wiring of the GPU profiles that breaks the calibration fails here. The bound is the issue's:
±15 % per operator at batches of ≥ 64 tokens.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from kvmeter.serving.simulator import RooflineCostModel, get_accelerator, get_model
from kvmeter.serving.simulator.calibrate_gpu import (ERROR_BOUND, ERROR_FLOOR_TOKENS, all_reduce_errors,
                                                     error_summary, fit_calibrations, load_compute_profiles,
                                                     operator_errors)
from kvmeter.serving.simulator.operators import (CALIBRATION_PATH, GEMM_OPS, LAYER_STREAM_OPS, OperatorModel,
                                                 layer_gemms)


@pytest.fixture(scope="module")
def errors() -> pl.DataFrame:
    return operator_errors()


@pytest.fixture(scope="module")
def measured() -> pl.DataFrame:
    return load_compute_profiles()


def _offenders(summary: pl.DataFrame, column: str) -> list[dict]:
    return summary.filter(pl.col(column) > ERROR_BOUND).to_dicts()


def test_every_operator_is_within_the_bound_at_64_tokens_and_more(errors):
    summary = error_summary(errors)
    # 2 GPUs × (4 GEMMs + 5 layer elementwise kernels + the embedding), each over 2 shapes × 4 TP degrees
    assert summary.height == 20 and set(summary["points"].to_list()) == {2 * 4 * 249}
    assert not _offenders(summary, "mean"), "mean |error| of an operator over the bound"
    assert not _offenders(summary, "median"), "median |error| of an operator over the bound"
    # the GEMMs (≥ 90 % of a layer's measured time) hold it for every shape and TP degree too; the
    # elementwise kernels of the smallest shards run 2-30 µs, which the profiles print to 1 µs, so
    # their per-shard medians are reported (bench/simulator/RESULTS.md), not bounded here
    per_group = error_summary(errors.filter(pl.col("op").is_in(GEMM_OPS)), by=("gpu", "model", "tp", "op"))
    assert per_group.height == 2 * 2 * 4 * 4
    assert not _offenders(per_group, "median"), "median |error| of a (GPU, shape, TP, GEMM) over the bound"


def test_the_gemm_fits_are_physical():
    # compute-bound GEMMs reach 70-80 % of the dense bf16 peak; weight-bound ones most of the bandwidth
    for gpu in ("h100", "a100"):
        cal = get_accelerator(gpu).calibration
        for op in GEMM_OPS:
            fit = cal.gemm[op]
            assert 0.6 < fit.peak_efficiency < 0.9 and 0.7 < fit.memory_efficiency <= 1.0, (gpu, op, fit)
            assert 10 < fit.half_tokens < 500 and fit.launch_s < 20e-6, (gpu, op, fit)


def test_all_reduce_error_over_the_sizes_of_64_token_batches():
    ar = all_reduce_errors().filter(pl.col("size_bytes") >= ERROR_FLOOR_TOKENS * 4096 * 2)
    two = ar.filter(pl.col("workers") == 2)
    # the profiles' term at 2 workers is the fit of the 2-worker measurements
    assert two.height > 900 and float(two["profile_error"].abs().mean()) <= ERROR_BOUND
    four = ar.filter(pl.col("workers") == 4)
    assert float(four["fit_error"].abs().mean()) <= ERROR_BOUND
    # the measured 4-GPU machine joins NVLink pairs over PCIe: several times slower than the NVSwitch
    # ring the SXM profiles derive from the 2-worker fit (documented; not used by any profile)
    assert float((four["measured_s"] / four["profile_s"]).median()) > 3


def _measured_step_ops(measured: pl.DataFrame, gpu: str, model: str, tp: int, tokens: int) -> tuple[float, float]:
    """(Σ of one layer's measured operators, the measured embedding) in seconds."""
    rows = measured.filter((pl.col("gpu") == gpu) & (pl.col("model") == model) & (pl.col("tp") == tp)
                           & (pl.col("tokens") == tokens))
    by_op = dict(zip(rows["op"].to_list(), rows["measured_s"].to_list(), strict=True))
    return sum(by_op[op] for op in (*GEMM_OPS, *LAYER_STREAM_OPS)), by_op["emb"]


def test_llama2_70b_tp1_prefill_of_4096_tokens_matches_the_measured_operators(measured):
    # 70B does not fit one GPU, so this one is the operator terms alone (no KV capacity to check)
    for gpu in ("h100", "a100"):
        acc, spec = get_accelerator(gpu), get_model("llama-2-70b")
        om = OperatorModel(spec, acc.flops("bf16"), acc.memory_bandwidth_bytes_per_s, 1, acc.calibration)
        layer, emb = _measured_step_ops(measured, gpu, "llama-2-70b", 1, 4096)
        assert om.step_time(4096, 0) == pytest.approx(80 * layer + emb, rel=ERROR_BOUND)
        assert layer > 0.008   # ≈ 10 ms a layer on H100, 30 ms on A100: the check is not vacuous


@pytest.mark.parametrize("gpu", ["h100", "a100"])
@pytest.mark.parametrize("model,tp", [("llama-2-7b", 1), ("llama-2-70b", 4)])
@pytest.mark.parametrize("tokens", [64, 4096])
def test_a_simulated_step_is_the_measured_operators_times_layers(measured, gpu, model, tp, tokens):
    """One step of the GPU profile as the simulator builds it: a 4,096-token prefill chunk, or 64
    decoding requests of 100 tokens of context each. Expected: the measured operators × layers +
    the measured embedding, plus the terms the profiles do not measure, computed here by hand —
    the LM head (one row per sequence), the two all-reduces per layer (tp > 1), attention on the
    roofline at the accelerator's default factors and the per-step overhead."""
    acc, spec = get_accelerator(gpu), get_model(model)
    cm = RooflineCostModel(spec, acc, tp=tp)
    assert cm.calibrated and cm.describe()["calibration"] == acc.calibration.basis
    cal, peak, bw = acc.calibration, acc.flops("bf16"), acc.memory_bandwidth_bytes_per_s
    layer, emb = _measured_step_ops(measured, gpu, model, tp, tokens)
    if tokens == 4096:
        rows, step = 1, cm.step_time(0, 0, [(0, 4096)])
        attn_ctx, kv_tokens = 4096 * 4097 / 2, 4096
    else:
        rows, step = 64, cm.step_time(64, 64 * 100)
        attn_ctx, kv_tokens = 64 * 100, 64 * 100
    lm_head = cal.gemm["gemm"].time_s(rows, spec.hidden_size, spec.vocab_size // tp, peak, bw)
    all_reduce = 0.0 if tp == 1 else cal.all_reduce.time_s(tokens * spec.hidden_size * 2, tp)
    attention = max(4 * spec.num_layers * spec.num_q_heads * spec.head_dim * attn_ctx / tp
                    / (peak * acc.default_compute_efficiency),
                    spec.kv_bytes_per_token * kv_tokens / tp / (bw * acc.default_memory_efficiency))
    expected = (acc.default_step_overhead_s + spec.num_layers * (layer + 2 * all_reduce) + emb + lm_head
                + attention)
    assert step == pytest.approx(expected, rel=ERROR_BOUND)
    # and not the plain roofline's answer for the same step, which misses the measured GEMMs
    plain = RooflineCostModel(spec, acc, tp=tp, use_calibration=False)
    plain_step = plain.step_time(0, 0, [(0, 4096)]) if tokens == 4096 else plain.step_time(64, 64 * 100)
    assert abs(plain_step / expected - 1) > abs(step / expected - 1)


def test_calibrated_decode_segments_match_single_steps():
    cm = RooflineCostModel(get_model("llama-3.1-70b"), get_accelerator("h200"), tp=4)
    assert cm.calibrated
    times = cm.decode_step_times(64, 100_000, 5)
    assert list(times) == pytest.approx([cm.step_time(64, 100_000 + 64 * j) for j in range(5)], rel=1e-12)
    assert cm.step_time(64, 100_000, [(0, 512)]) > cm.step_time(64, 100_000) > 0


def test_h200_is_the_h100_fit_on_the_h200_peaks():
    h100, h200 = get_accelerator("h100"), get_accelerator("h200")
    assert h200.calibration.gemm == h100.calibration.gemm
    assert h200.calibration.stream == h100.calibration.stream
    assert h200.calibration.all_reduce == h100.calibration.all_reduce
    assert "derived, not measured" in h200.calibration.basis
    spec = get_model("llama-3.1-70b")
    ops = {g.name: OperatorModel(spec, g.flops("bf16"), g.memory_bandwidth_bytes_per_s, 4, g.calibration)
           for g in (h100, h200)}
    small = [ops[n].operator_times(1)["mlp_up_proj"] for n in ("h100", "h200")]
    large = [ops[n].operator_times(4096)["mlp_up_proj"] for n in ("h100", "h200")]
    launch = h100.calibration.gemm["mlp_up_proj"].launch_s
    # weight-bound: faster by the bandwidth ratio (4.8 / 3.35); compute-bound: the same
    assert (small[0] - launch) / (small[1] - launch) == pytest.approx(4.8 / 3.35, rel=0.01)
    assert large[0] == pytest.approx(large[1], rel=1e-9)


def test_plain_roofline_where_no_calibration_applies():
    # explicit factors (a fit such as calibration.py's, or the CLI flags) select the plain roofline
    assert not RooflineCostModel(get_model("llama-2-7b"), get_accelerator("h100"), compute_efficiency=0.5).calibrated
    assert not RooflineCostModel(get_model("smollm2-135m"), get_accelerator("cpu")).calibrated
    assert not RooflineCostModel(get_model("llama-2-7b"), get_accelerator("a10")).calibrated
    assert not RooflineCostModel(get_model("mla-78l"), get_accelerator("h200"), tp=8).calibrated  # no layer shapes
    with pytest.raises(ValueError, match="no GPU calibration applies"):
        RooflineCostModel(get_model("smollm2-135m"), get_accelerator("cpu"), use_calibration=True)
    with pytest.raises(ValueError, match="do not split"):
        RooflineCostModel(get_model("smollm2-135m"), get_accelerator("h100"), tp=2)   # 9 query heads


@pytest.mark.parametrize("name,embeddings", [("llama-3.1-70b", 2), ("llama-2-70b", 2), ("llama-2-7b", 2),
                                             ("qwen2.5-32b", 2), ("smollm2-135m", 1)])   # SmolLM2 ties its embeddings
def test_layer_shapes_add_up_to_the_parameter_count(name, embeddings):
    spec = get_model(name)
    per_layer = sum(g.k * g.n for g in layer_gemms(spec, 1))
    total = spec.num_layers * per_layer + embeddings * spec.vocab_size * spec.hidden_size
    assert total == pytest.approx(spec.total_params, rel=0.01)


@pytest.mark.slow
def test_the_stored_parameters_are_the_fit_of_the_data():
    stored = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    fresh = fit_calibrations()
    assert fresh["gpus"] == stored["gpus"]
    assert fresh["all_reduce_measured"] == stored["all_reduce_measured"]
    assert np.isfinite([v for g in stored["gpus"].values() for f in g["gemm"].values() for v in f.values()]).all()
