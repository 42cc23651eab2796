"""Fit the simulator's GPU operator terms to measured kernel times, and report their error.

``python -m kvmeter.serving.simulator.calibrate_gpu [--report PATH]`` reads the Vidur profiles in
``data/gpu_profiles/vidur`` (per-operator medians measured on H100 and A100 for Llama-2-7B and
Llama-2-70B shapes, 1–4,096 tokens, tensor-parallel shards 1/2/4/8; all-reduce over 2 and 4 H100s
joined pairwise by NVLink; see ``data/SOURCES.md``), fits the terms of :mod:`.operators`, writes
them to ``operators.CALIBRATION_PATH`` (``gpu_calibration.json``) and prints the error summary;
``--report`` also writes the per-operator, per-batch-size error tables as Markdown.

Method (deterministic; numpy only — scipy is not a kvmeter dependency):

* the measurement of a (GPU, shape, TP, tokens) point is the median of the rows' medians;
* per GPU and operator, the parameters minimise the sum of squared log errors
  ``Σ log(t_pred / t_meas)²`` over every measured point of both shapes and all four TP degrees
  (1–4,096 tokens) — relative error, so a 4,096-token GEMM does not outweigh a decode-sized one;
* the minimiser is a coarse-to-fine grid search: a 5-point grid per parameter around the best
  point so far, the grid's span shrunk ×0.7 each round, 24 rounds, from three starting centres;
* the pooled ``gemm`` fit (all four layer GEMMs together) times GEMMs that have no profile of
  their own (the LM head);
* the all-reduce is fitted per worker count to the 2-worker and 4-worker measurements.

What each profile uses (the ``basis`` strings in the JSON say the same):

* ``h100``, ``a100``: their own GEMM and elementwise fits.
* ``h200``: no measured profile; the H100's fits, applied to the H200's own peaks — the same
  Hopper compute (989.5 TFLOP/s bf16 dense) with 4.8 TB/s of HBM3e instead of 3.35 TB/s, so the
  weight-bound (small-batch) terms get faster by the bandwidth ratio. *Derived, not measured.*
* all-reduce, ``h100``/``h200``: the 2-worker fit (one NVLink hop). The simulator's profiles are
  SXM boards on NVSwitch, where every GPU reaches every other over NVLink, so the fit is applied
  to any TP degree through the ring's ``2(n−1)/n`` bus-traffic factor (*derived for n > 2*). The
  4-worker measurement is not used: on the measured machine two NVLink pairs talk over PCIe
  (bus bandwidth ≈ 50 GB/s vs ≈ 195 GB/s within a pair), which an NVSwitch node does not do.
* all-reduce, ``a100``: not measured; the H100's 2-worker fit with the bus bandwidth scaled by
  the NVLink bandwidth ratio, 600 GB/s (NVLink 3) / 900 GB/s (NVLink 4). *Derived.*

The error report (:func:`operator_errors`, :func:`all_reduce_errors`) recomputes every prediction
through :class:`~.operators.OperatorModel` — the object the cost model uses — so a change to the
formulas or the stored numbers shows up in it (and in ``tests/serving/simulator/test_gpu_calibration.py``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import polars as pl

from kvmeter.scalars import number
from kvmeter.traces import data_dir

from .hardware import ACCELERATORS, AcceleratorSpec
from .models import MODELS
from .operators import (CALIBRATION_PATH, GEMM_OPS, LAYER_STREAM_OPS, POOLED_GEMM, STEP_STREAM_OPS,
                        AllReduceFit, GpuCalibration, OperatorModel, all_reduce_time_s, gemm_time_s,
                        layer_gemms, layer_stream_bytes_per_token, load_calibrations, stream_time_s)

__all__ = [
    "PROFILE_DIR", "COMPUTE_PROFILES", "ALL_REDUCE_PROFILE", "ERROR_FLOOR_TOKENS", "ERROR_BOUND",
    "load_compute_profiles", "load_all_reduce_profile", "fit_calibrations", "operator_errors",
    "all_reduce_errors", "error_summary", "markdown_report", "main",
]

#: Folder of the profiles inside the data folder.
PROFILE_DIR = "gpu_profiles/vidur"
#: (GPU, model registry name) → compute profile file.
COMPUTE_PROFILES: Mapping[tuple[str, str], str] = {
    ("h100", "llama-2-7b"): "compute_h100_meta-llama_Llama-2-7b-hf_mlp.csv",
    ("h100", "llama-2-70b"): "compute_h100_meta-llama_Llama-2-70b-hf_mlp.csv",
    ("a100", "llama-2-7b"): "compute_a100_meta-llama_Llama-2-7b-hf_mlp.csv",
    ("a100", "llama-2-70b"): "compute_a100_meta-llama_Llama-2-70b-hf_mlp.csv",
}
ALL_REDUCE_PROFILE = "network_h100_pairwise_nvlink_all_reduce.csv"
#: The issue's floor: errors are judged at batches of at least this many tokens.
ERROR_FLOOR_TOKENS = 64
#: The issue's bound on the relative error per operator.
ERROR_BOUND = 0.15
#: NVLink bandwidth per GPU, A100 (NVLink 3) over H100 (NVLink 4): 600 / 900 GB/s (datasheets).
A100_NVLINK_SCALE = 600.0 / 900.0
_MEASURED_GPUS = ("h100", "a100")
_OPS = (*GEMM_OPS, *LAYER_STREAM_OPS, *STEP_STREAM_OPS)


# ------------------------------------------------------------------------------------ loading
def load_compute_profiles(root: Path | None = None) -> pl.DataFrame:
    """Measured operator times, one row per (gpu, model, tp, op, tokens): columns ``gpu``,
    ``model`` (registry name), ``tp``, ``op``, ``tokens``, ``measured_s`` (median of the rows'
    medians, seconds). Raises FileNotFoundError for a missing profile."""
    base = (root or data_dir()) / PROFILE_DIR
    frames = []
    for (gpu, model), name in COMPUTE_PROFILES.items():
        path = base / name
        if not path.is_file():
            raise FileNotFoundError(f"GPU profile {path} not found (see data/SOURCES.md)")
        df = pl.read_csv(path)
        cols = {f"time_stats.{op}.median": op for op in _OPS}
        agg = (df.group_by("num_tokens", "num_tensor_parallel_workers")
               .agg([pl.col(c).median().alias(op) for c, op in cols.items()]))
        long = agg.unpivot(index=["num_tokens", "num_tensor_parallel_workers"], on=list(cols.values()),
                           variable_name="op", value_name="ms")
        frames.append(long.select(pl.lit(gpu).alias("gpu"), pl.lit(model).alias("model"),
                                  pl.col("num_tensor_parallel_workers").cast(pl.Int64).alias("tp"), "op",
                                  pl.col("num_tokens").cast(pl.Int64).alias("tokens"),
                                  (pl.col("ms") * 1e-3).alias("measured_s")))
    return pl.concat(frames).sort("gpu", "model", "tp", "op", "tokens")


def load_all_reduce_profile(root: Path | None = None) -> pl.DataFrame:
    """Measured all-reduce times: columns ``workers``, ``size_bytes``, ``measured_s``."""
    path = (root or data_dir()) / PROFILE_DIR / ALL_REDUCE_PROFILE
    if not path.is_file():
        raise FileNotFoundError(f"GPU profile {path} not found (see data/SOURCES.md)")
    df = pl.read_csv(path)
    return (df.group_by("num_workers", "size").agg(pl.col("time_stats.all_reduce.median").median())
            .select(pl.col("num_workers").cast(pl.Int64).alias("workers"),
                    pl.col("size").cast(pl.Int64).alias("size_bytes"),
                    (pl.col("time_stats.all_reduce.median") * 1e-3).alias("measured_s"))
            .sort("workers", "size_bytes"))


# ------------------------------------------------------------------------------------ fitting
def _grid_fit(predict: Callable[[np.ndarray], np.ndarray], bounds: Sequence[tuple[float, float]],
              measured: np.ndarray) -> np.ndarray:
    """Parameters within ``bounds`` minimising ``Σ log(predict(p) / measured)²``.

    ``predict`` maps a (P, k) array of parameter rows to (P, N) predictions. Coarse-to-fine grid
    search (see the module docstring); deterministic."""
    lo = np.array([b[0] for b in bounds], dtype=float)
    hi = np.array([b[1] for b in bounds], dtype=float)
    log_meas = np.log(measured)[None, :]
    best_p: np.ndarray | None = None
    best_s = np.inf
    for start in (0.25, 0.5, 0.75):
        centre, span = lo + (hi - lo) * start, (hi - lo) / 2.0
        for _ in range(24):
            axes = [np.clip(np.linspace(c - s, c + s, 5), a, b)
                    for c, s, a, b in zip(centre, span, lo, hi, strict=True)]
            grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(bounds))
            err = np.log(predict(grid)) - log_meas
            score = np.einsum("ij,ij->i", err, err)
            i = int(np.argmin(score))
            if score[i] < best_s:
                best_s, best_p = float(score[i]), grid[i].copy()
            if best_p is None:
                raise ValueError("no finite fit error on the parameter grid (a NaN or infinite prediction)")
            centre, span = best_p, span * 0.7
    assert best_p is not None  # (set on the first grid, or raised above)
    return best_p


def _shape_arrays(rows: pl.DataFrame, op: str) -> dict[str, np.ndarray]:
    """Per-row GEMM shard (k, n) or streamed bytes of ``op``, with the model's weight element size."""
    k, n, nbytes, wb = [], [], [], []
    for model, tp, tokens in rows.select("model", "tp", "tokens").iter_rows():
        spec = MODELS[model]
        if op in GEMM_OPS:
            g = next(s for s in layer_gemms(spec, tp) if s.name == op)
            k.append(g.k)
            n.append(g.n)
        else:
            nbytes.append(layer_stream_bytes_per_token(spec, tp)[op] * tokens)
        wb.append(spec.weight_bytes_per_param)
    return {"k": np.array(k, float), "n": np.array(n, float), "bytes": np.array(nbytes, float),
            "wb": np.array(wb, float), "tokens": rows["tokens"].to_numpy().astype(float)}


def _fit_gemm(rows: pl.DataFrame, ops: Sequence[str], acc: AcceleratorSpec) -> dict[str, float]:
    parts = [(_shape_arrays(rows.filter(pl.col("op") == op), op), rows.filter(pl.col("op") == op))
             for op in ops]
    x = {key: np.concatenate([p[0][key] for p in parts]) for key in ("k", "n", "wb", "tokens")}
    meas = np.concatenate([p[1]["measured_s"].to_numpy() for p in parts])
    peak, bw = acc.flops("bf16"), acc.memory_bandwidth_bytes_per_s

    def predict(p: np.ndarray) -> np.ndarray:
        c = [p[:, i:i + 1] for i in range(4)]
        return gemm_time_s(x["tokens"], x["k"], x["n"], peak, bw, x["wb"], c[0], c[1], c[2], c[3])

    p = _grid_fit(predict, [(0.05, 1.0), (0.0, 1000.0), (0.05, 1.0), (0.0, 50e-6)], meas)
    return {"peak_efficiency": _sig(p[0]), "half_tokens": _sig(p[1]), "memory_efficiency": _sig(p[2]),
            "launch_s": _sig(p[3])}


def _fit_stream(rows: pl.DataFrame, op: str, acc: AcceleratorSpec) -> dict[str, float]:
    x = _shape_arrays(rows, op)
    bw = acc.memory_bandwidth_bytes_per_s
    p = _grid_fit(lambda p: stream_time_s(x["bytes"], bw, p[:, 0:1], p[:, 1:2], p[:, 2:3], p[:, 3:4]),
                  [(0.01, 1.0), (0.0, 50e-6), (0.01, 3.0), (0.0, 200e6)], rows["measured_s"].to_numpy())
    return {"memory_efficiency": _sig(p[0]), "launch_s": _sig(p[1]), "cached_efficiency": _sig(p[2]),
            "cached_bytes": _sig(p[3])}


def _fit_all_reduce(rows: pl.DataFrame, workers: int) -> dict[str, float]:
    size = rows["size_bytes"].to_numpy().astype(float)
    # the grid runs over seconds per byte (1 / bandwidth): the model is linear in it
    p = _grid_fit(lambda p: all_reduce_time_s(size, workers, p[:, 0:1], 1.0 / p[:, 1:2]),
                  [(0.0, 200e-6), (1e-13, 1e-9)], rows["measured_s"].to_numpy())
    return {"latency_s": _sig(p[0]), "bus_bandwidth_bytes_per_s": _sig(1.0 / p[1])}


def fit_calibrations(root: Path | None = None) -> dict:
    """Fit every term to the profiles under ``root`` (the data folder); returns the JSON document
    :func:`~.operators.load_calibrations` reads (see the module docstring for what each GPU gets)."""
    compute = load_compute_profiles(root)
    network = load_all_reduce_profile(root)
    measured_ar = {str(w): _fit_all_reduce(network.filter(pl.col("workers") == w), w)
                   for w in sorted(network["workers"].unique().to_list())}
    nvlink = dict(measured_ar["2"])
    gpus: dict[str, dict] = {}
    for gpu in _MEASURED_GPUS:
        acc, rows = ACCELERATORS[gpu], compute.filter(pl.col("gpu") == gpu)
        gemm = {op: _fit_gemm(rows, [op], acc) for op in GEMM_OPS}
        gemm[POOLED_GEMM] = _fit_gemm(rows, GEMM_OPS, acc)
        stream = {op: _fit_stream(rows.filter(pl.col("op") == op), op, acc)
                  for op in (*LAYER_STREAM_OPS, *STEP_STREAM_OPS)}
        gpus[gpu] = {"basis": f"fitted to the Vidur {gpu.upper()} profiles (Llama-2-7B and -70B shapes, "
                              "1-4,096 tokens, TP 1/2/4/8)", "gemm": gemm, "stream": stream}
    gpus["h100"]["all_reduce"] = {
        **nvlink, "basis": "fitted to the 2-worker H100 NVLink all-reduce; applied to n workers through the "
                           "ring's 2(n-1)/n (NVSwitch: every pair on NVLink) - derived for n > 2"}
    gpus["a100"]["all_reduce"] = {
        **nvlink, "bus_bandwidth_bytes_per_s": _sig(nvlink["bus_bandwidth_bytes_per_s"] * A100_NVLINK_SCALE),
        "basis": "derived, not measured: the H100 2-worker fit with the bus bandwidth x 600/900 "
                 "(NVLink 3 vs NVLink 4 per GPU)"}
    gpus["h200"] = {**json.loads(json.dumps(gpus["h100"])),
                    "basis": "derived, not measured: the H100's fitted fractions of peak applied to the H200's "
                             "peaks (same compute, 4.8 TB/s HBM3e)"}
    return {
        "about": "GPU operator terms of the simulator's cost model (serving/simulator/operators.py). Generated by "
                 "`python -m kvmeter.serving.simulator.calibrate_gpu`; do not edit by hand.",
        "source": f"data/{PROFILE_DIR} (microsoft/vidur, MIT; see data/SOURCES.md)",
        "method": "per GPU and operator, least squares on log(predicted / measured) over every measured point, "
                  "coarse-to-fine grid search (calibrate_gpu.py)",
        "units": "seconds, bytes/s, tokens; efficiencies are fractions of the accelerator's spec-sheet peak",
        "gpus": gpus,
        "all_reduce_measured": {"h100_pairwise_nvlink": measured_ar},
    }


def _sig(x: float) -> float:
    return float(f"{float(x):.6g}")


# ------------------------------------------------------------------------------------- errors
def _calibrations(calibrations: Mapping[str, GpuCalibration] | None) -> Mapping[str, GpuCalibration]:
    if calibrations is not None:
        return calibrations
    out: dict[str, GpuCalibration] = {}
    for g in _MEASURED_GPUS:
        cal = ACCELERATORS[g].calibration
        if cal is None:  # (every measured GPU names its calibration in hardware.py)
            raise ValueError(f"{g}: no GPU calibration")
        out[g] = cal
    return out


def operator_errors(calibrations: Mapping[str, GpuCalibration] | None = None,
                    root: Path | None = None) -> pl.DataFrame:
    """Measured vs predicted time of every profiled operator point: the columns of
    :func:`load_compute_profiles` plus ``predicted_s`` (through :class:`~.operators.OperatorModel`
    with ``calibrations``, default: the profiles' own) and ``rel_error`` (predicted / measured − 1)."""
    cals = _calibrations(calibrations)
    compute = load_compute_profiles(root)
    pred: dict[tuple, float] = {}
    for gpu, model, tp in compute.select("gpu", "model", "tp").unique().iter_rows():
        acc, spec = ACCELERATORS[gpu], MODELS[model]
        om = OperatorModel(spec, acc.flops(spec.compute_dtype), acc.memory_bandwidth_bytes_per_s, tp, cals[gpu])
        for tokens in compute.filter((pl.col("gpu") == gpu) & (pl.col("model") == model)
                                     & (pl.col("tp") == tp))["tokens"].unique().to_list():
            for op, t in om.operator_times(int(tokens)).items():
                pred[(gpu, model, tp, op, int(tokens))] = t
    keys = compute.select("gpu", "model", "tp", "op", "tokens").iter_rows()
    out = compute.with_columns(pl.Series("predicted_s", [pred[k] for k in keys], dtype=pl.Float64))
    return out.with_columns((pl.col("predicted_s") / pl.col("measured_s") - 1.0).alias("rel_error"))


def all_reduce_errors(calibrations: Mapping[str, GpuCalibration] | None = None,
                      measured_fits: Mapping[str, Mapping[str, float]] | None = None,
                      root: Path | None = None) -> pl.DataFrame:
    """Measured vs predicted all-reduce times: columns ``workers``, ``size_bytes``, ``measured_s``,
    ``profile_s`` (the ``h100`` profile's term — fitted at 2 workers, derived at 4),
    ``fit_s`` (the fit of that worker count's own measurements, from ``measured_fits`` or the
    stored file), and their relative errors ``profile_error`` and ``fit_error``."""
    cal = _calibrations(calibrations)["h100"].all_reduce
    if cal is None:
        raise ValueError("the h100 calibration has no all-reduce fit")
    if measured_fits is None:
        doc = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
        measured_fits = doc["all_reduce_measured"]["h100_pairwise_nvlink"]
    net = load_all_reduce_profile(root)
    rows = []
    for workers, size, _measured in net.iter_rows():
        own = AllReduceFit(**measured_fits[str(workers)])
        rows.append((float(cal.time_s(size, workers)), float(own.time_s(size, workers))))
    out = net.with_columns(pl.Series("profile_s", [r[0] for r in rows]), pl.Series("fit_s", [r[1] for r in rows]))
    return out.with_columns((pl.col("profile_s") / pl.col("measured_s") - 1).alias("profile_error"),
                            (pl.col("fit_s") / pl.col("measured_s") - 1).alias("fit_error"))


def error_summary(errors: pl.DataFrame, floor_tokens: int = ERROR_FLOOR_TOKENS,
                  by: Sequence[str] = ("gpu", "op")) -> pl.DataFrame:
    """Absolute relative error over the points with ``tokens ≥ floor_tokens``, grouped ``by``:
    ``points``, ``mean``, ``median``, ``p90``, ``max`` and ``over_bound`` (share of points above
    :data:`ERROR_BOUND`)."""
    a = pl.col("rel_error").abs()
    return (errors.filter(pl.col("tokens") >= floor_tokens).group_by(*by)
            .agg(pl.len().alias("points"), a.mean().alias("mean"), a.median().alias("median"),
                 a.quantile(0.9, "linear").alias("p90"), a.max().alias("max"),
                 (a > ERROR_BOUND).mean().alias("over_bound"))
            .sort(*by))


# ------------------------------------------------------------------------------------- report
_REPORT_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _share(value: object) -> str:
    """A polars reduction of a fraction column as ``12.3%`` (``—`` when empty)."""
    x = number(value)
    return "—" if x is None else f"{x:.1%}"


def markdown_report(errors: pl.DataFrame, ar: pl.DataFrame) -> str:
    """The error tables as Markdown (what ``--report`` writes)."""
    lines = [(f"<!-- generated by `python -m kvmeter.serving.simulator.calibrate_gpu --report` on "
              f"{_dt.date.today().isoformat()}; do not edit by hand -->"),
             "# Simulator GPU operator terms vs the measured Vidur profiles", "",
             (f"Relative error = predicted / measured − 1 of the median time; the bound is ±{ERROR_BOUND:.0%} "
              f"at batches of ≥ {ERROR_FLOOR_TOKENS} tokens. Predictions come from "
              "`serving/simulator/operators.py` with the numbers in `gpu_calibration.json`."), "",
             (f"## Summary per GPU and operator (|error| over every measured point ≥ {ERROR_FLOOR_TOKENS} tokens, "
              "both shapes, TP 1/2/4/8)"), "",
             "| GPU | operator | points | mean | median | p90 | max | share > 15% |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in error_summary(errors).iter_rows(named=True):
        lines.append(f"| {r['gpu']} | {r['op']} | {r['points']} | {r['mean']:.1%} | {r['median']:.1%} | "
                     f"{r['p90']:.1%} | {r['max']:.1%} | {r['over_bound']:.1%} |")
    lines += ["", "## Per shape and TP degree (median |error| ≥ 64 tokens; worst group first)", "",
              "| GPU | model | TP | operator | median | p90 | max |", "|---|---|---:|---|---:|---:|---:|"]
    per = error_summary(errors, by=("gpu", "model", "tp", "op")).sort("median", descending=True)
    for r in per.head(12).iter_rows(named=True):
        lines.append(f"| {r['gpu']} | {r['model']} | {r['tp']} | {r['op']} | {r['median']:.1%} | "
                     f"{r['p90']:.1%} | {r['max']:.1%} |")
    for gpu in sorted(errors["gpu"].unique().to_list()):
        for model in sorted(errors["model"].unique().to_list()):
            for tp in (1, 4):
                sub = errors.filter((pl.col("gpu") == gpu) & (pl.col("model") == model) & (pl.col("tp") == tp)
                                    & pl.col("tokens").is_in(list(_REPORT_TOKENS)))
                lines += ["", f"## {gpu} · {model} · TP {tp}: measured / predicted ms (error)", "",
                          "| operator | " + " | ".join(str(t) for t in _REPORT_TOKENS) + " |",
                          "|---|" + "---:|" * len(_REPORT_TOKENS)]
                for op in _OPS:
                    cells = []
                    for t in _REPORT_TOKENS:
                        row = sub.filter((pl.col("op") == op) & (pl.col("tokens") == t))
                        if row.height == 0:
                            cells.append("—")
                            continue
                        m, p, e = row.row(0, named=True)["measured_s"], row.row(0, named=True)["predicted_s"], \
                            row.row(0, named=True)["rel_error"]
                        cells.append(f"{m * 1e3:.3f} / {p * 1e3:.3f} ({_pct(e)})")
                    lines.append(f"| {op} | " + " | ".join(cells) + " |")
                layer = sub.filter(pl.col("op") != "emb").group_by("tokens").agg(
                    pl.col("measured_s").sum(), pl.col("predicted_s").sum())
                cells = []
                for t in _REPORT_TOKENS:
                    row = layer.filter(pl.col("tokens") == t)
                    m, p = row["measured_s"][0], row["predicted_s"][0]
                    cells.append(f"{m * 1e3:.3f} / {p * 1e3:.3f} ({_pct(p / m - 1)})")
                lines.append("| **one layer (Σ)** | " + " | ".join(cells) + " |")
    lines += ["", "## All-reduce (H100, pairwise NVLink), by message size", "",
              ("`profile`: the h100/h200 profiles' term (the 2-worker fit; at 4 workers derived through the "
               "ring factor, i.e. what an NVSwitch node would do). `own fit`: a fit to that worker count's "
               "measurements. |error| over the sizes of ≥ 64-token batches (≥ 512 KiB):"), "",
              "| workers | sizes | profile mean | profile max | own fit mean | own fit max |",
              "|---:|---:|---:|---:|---:|---:|"]
    big = ar.filter(pl.col("size_bytes") >= ERROR_FLOOR_TOKENS * 4096 * 2)
    for (w,), g in sorted(big.group_by("workers"), key=lambda kv: kv[0]):
        pe, fe = g["profile_error"].abs(), g["fit_error"].abs()
        lines.append(f"| {w} | {g.height} | {_share(pe.mean())} | {_share(pe.max())} "
                     f"| {_share(fe.mean())} | {_share(fe.max())} |")
    lines += ["", "| workers | size | measured ms | profile ms (error) | own fit ms (error) |",
              "|---:|---:|---:|---:|---:|"]
    for size in (2 ** 11, 2 ** 16, 2 ** 19, 2 ** 20, 2 ** 22, 2 ** 24, 2 ** 26):
        for w in (2, 4):
            g = ar.filter(pl.col("workers") == w)
            i = int(np.argmin(np.abs(g["size_bytes"].to_numpy() - size)))
            r = g.row(i, named=True)
            lines.append(f"| {w} | {r['size_bytes']:,} B | {r['measured_s'] * 1e3:.3f} | {r['profile_s'] * 1e3:.3f} "
                         f"({_pct(r['profile_error'])}) | {r['fit_s'] * 1e3:.3f} ({_pct(r['fit_error'])}) |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Fit, write the parameters, print the summary; 0 when every operator's mean error ≥ 64 tokens
    is within the bound, 1 when one misses it."""
    ap = argparse.ArgumentParser(prog="python -m kvmeter.serving.simulator.calibrate_gpu",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=None, help="data folder (default: kvmeter's)")
    ap.add_argument("--out", type=Path, default=CALIBRATION_PATH, help=f"parameters file (default {CALIBRATION_PATH})")
    ap.add_argument("--report", type=Path, default=None, help="also write the error tables (Markdown) here")
    args = ap.parse_args(argv)
    doc = fit_calibrations(args.data_dir)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    cals = load_calibrations(args.out)
    errors = operator_errors(cals, args.data_dir)
    summary = error_summary(errors)
    with pl.Config(tbl_rows=100, float_precision=3):
        print(summary)
    if args.report:
        ar = all_reduce_errors(cals, doc["all_reduce_measured"]["h100_pairwise_nvlink"], args.data_dir)
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(markdown_report(errors, ar), encoding="utf-8")
        print(f"wrote {args.report}")
    worst = number(summary["mean"].max())
    return 0 if worst is not None and worst <= ERROR_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
