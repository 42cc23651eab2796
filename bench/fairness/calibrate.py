"""Calibrate the simulator against a real engine: a recipe in two steps.

1. **measure** — replay a trace slice on the real engine and record per-request TTFT and ITLs::

       .venv/bin/python bench/fairness/calibrate.py measure \\
           --out bench/fairness/results/vllm_cpu_measured.json

   The slice is the demo's (``kvmeter demo`` / ``bench/fairness/real_engine.py``): the first
   ``--limit`` requests of the Azure conversation trace 2023 with the demo's scaling rule (token
   lengths × ``--token-scale``, arrivals ÷ ``--time-compression``; ``kvmeter.serving.replay.plan``),
   without the noisy tenant. It starts vLLM's ``AsyncLLM`` in-process with the demo's engine
   settings (``serving/config.py`` ``DEMO_ENGINE_SETTINGS``: the step token budget; prefix caching
   off, as the simulator's trace has no shared prefixes), submits each request at its arrival time
   (random prompt token ids of the slice's length, ``min_tokens = max_tokens =`` its output length,
   ``ignore_eos``) and records arrival → first token and the gaps between tokens (per token,
   ``RequestOutputKind.DELTA``). The measurement file keeps the slice itself, so the fit replays
   exactly what the engine saw. Measure with a low load average (``uptime``): the engine's speed is
   the machine's.

2. **fit** — grid-search the accelerator profile's compute efficiency, memory efficiency and step
   overhead so the simulator's TTFT p50 and ITL p50 on the same slice, with the same engine limits,
   match (target: both within 20 %)::

       .venv/bin/python bench/fairness/calibrate.py fit bench/fairness/results/vllm_cpu_measured.json \\
           --model smollm2-135m --gpu cpu

   It prints the factors and writes ``<measured>.fit.json``; put them into the accelerator profile
   (``serving/simulator/hardware.py``: ``default_compute_efficiency``,
   ``default_memory_efficiency``, ``default_step_overhead_s``) or pass them to ``kvmeter simulate
   --compute-efficiency/--memory-efficiency/--step-overhead-s``.

3. **check** — compare a measurement with the profile's *current* factors, no fitting (e.g. a
   second slice or other engine settings, to see the fit carry over)::

       .venv/bin/python bench/fairness/calibrate.py check <measurement.json> --model smollm2-135m --gpu cpu

**On a GPU** (the recipe to recalibrate a GPU profile): install the CUDA build of vLLM, then the
same two commands with the GPU's model and settings — ``measure --model-path <HF model dir>
--tp <N> --max-num-batched-tokens <the deployment's> --max-num-seqs <the deployment's>
--token-scale 1 --time-compression <load you want>`` and ``fit <file> --model <the simulator's
name of that model, e.g. llama-3.1-70b> --gpu h100|h200 --tp <N>``. Use a slice that keeps the
GPU busy but not saturated (TTFT near the prefill time), so the fit sees step costs rather than
queueing; widen the ``--compute``/``--memory`` grids if a factor lands on an edge. The fitted
factors time the *whole* step (the plain roofline): on the h100/a100/h200 profiles they replace
the per-operator calibration (``serving/simulator/operators.py``), which is fitted to measured
kernel times instead (``python -m kvmeter.serving.simulator.calibrate_gpu``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvmeter.serving.simulator import SimConfig
from kvmeter.serving.simulator.calibration import fit_efficiency, simulated_medians
from kvmeter.traces import TraceRequest


def demo_slice(trace: str, limit: int, token_scale: float, time_compression: float,
               seed: int = 7) -> list[TraceRequest]:
    """The first ``limit`` requests of ``trace`` under the demo's scaling rule (no noisy tenant)."""
    from kvmeter.serving.replay.plan import ReplayTenant, ScalingRule, build_plan
    from kvmeter.traces import load_trace

    rule = ScalingRule(time_compression=time_compression, token_scale=token_scale)
    plan = build_plan(load_trace(trace, limit=limit), [ReplayTenant("calibration", "-")], rule, seed=seed)
    return [TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens) for r in plan]


async def _measure(args: argparse.Namespace) -> dict:  # pragma: no cover - needs the vLLM engine
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvmeter.model import resolve_model

    reqs = demo_slice(args.trace, args.limit, args.token_scale, args.time_compression)
    model_path = args.model_path or str(resolve_model(None)[0])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model_path, max_model_len=args.max_model_len, tensor_parallel_size=args.tp,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        **({"long_prefill_token_threshold": args.long_prefill_token_threshold}
           if args.long_prefill_token_threshold else {})))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20_000, r.input_tokens).tolist() for r in reqs]
    load0 = os.getloadavg()
    t0 = time.monotonic()
    results: list[dict | None] = [None] * len(reqs)

    async def one(i: int, r: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
        start = time.monotonic()
        sp = SamplingParams(max_tokens=r.output_tokens, min_tokens=r.output_tokens, ignore_eos=True,
                            temperature=0.0, output_kind=RequestOutputKind.DELTA)
        stamps: list[float] = []
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), sp, request_id=f"cal-{i}"):
            now = time.monotonic()
            n = len(out.outputs[0].token_ids)
            if stamps and n > 1:  # several tokens in one delta: spread the gap evenly
                prev = stamps[-1]
                stamps.extend(prev + (now - prev) * (k + 1) / n for k in range(n))
            else:
                stamps.extend([now] * n)
        results[i] = {"arrival_s": r.arrival_s, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                      "ttft_s": stamps[0] - start, "itls_s": list(np.diff(stamps))}

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    finally:
        engine.shutdown()
    done = [x for x in results if x is not None]
    ttft = float(np.median([x["ttft_s"] for x in done]))
    itl = float(np.median([v for x in done for v in x["itls_s"]]))
    return {"trace": args.trace, "limit": args.limit, "token_scale": args.token_scale,
            "time_compression": args.time_compression, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "tp": args.tp, "model_path": model_path, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "load_average_before": load0, "load_average_after": os.getloadavg(),
            "wall_s": time.monotonic() - t0, "ttft_p50_s": ttft, "itl_p50_s": itl, "requests": done}


def _measured_requests(data: dict) -> list[TraceRequest]:
    return [TraceRequest(float(x["arrival_s"]), int(x["input_tokens"]), int(x["output_tokens"]))
            for x in data["requests"]]


def main(argv: list[str] | None = None) -> int:
    from kvmeter.serving.config import DEMO_ENGINE_SETTINGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="replay a slice on the real vLLM engine (starts it)")
    m.add_argument("--model-path", default=None, help="model directory (default: the prepared SmolLM2)")
    m.add_argument("--trace", default="azure-conv")
    m.add_argument("--limit", type=int, default=100)
    m.add_argument("--token-scale", type=float, default=1 / 8)
    m.add_argument("--time-compression", type=float, default=0.5)
    m.add_argument("--max-model-len", type=int, default=DEMO_ENGINE_SETTINGS["max_model_len"])
    m.add_argument("--max-num-batched-tokens", type=int, default=DEMO_ENGINE_SETTINGS["max_num_batched_tokens"])
    m.add_argument("--max-num-seqs", type=int, default=128)
    m.add_argument("--long-prefill-token-threshold", type=int,
                   default=DEMO_ENGINE_SETTINGS.get("long_prefill_token_threshold"))
    m.add_argument("--tp", type=int, default=1)
    m.add_argument("--out", required=True)
    f = sub.add_parser("fit", help="fit the simulator's factors to a measurement file")
    f.add_argument("measured")
    f.add_argument("--model", default="smollm2-135m")
    f.add_argument("--gpu", default="cpu")
    f.add_argument("--tp", type=int, default=1)
    f.add_argument("--compute", type=float, nargs="+", default=list(np.round(np.linspace(0.05, 1.0, 20), 3)))
    f.add_argument("--memory", type=float, nargs="+", default=list(np.round(np.linspace(0.05, 1.0, 20), 3)))
    f.add_argument("--overhead-s", type=float, nargs="+", default=[0.0, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04])
    c = sub.add_parser("check", help="compare a measurement with the profile's current factors (no fit)")
    c.add_argument("measured")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--gpu", default="cpu")
    c.add_argument("--tp", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cmd == "measure":  # pragma: no cover - needs the vLLM engine
        data = asyncio.run(_measure(args))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2))
        print(f"TTFT p50 {data['ttft_p50_s']:.4f} s, ITL p50 {data['itl_p50_s']:.4f} s over "
              f"{len(data['requests'])} requests; load average {data['load_average_before'][0]:.2f} → "
              f"{data['load_average_after'][0]:.2f} → {args.out}")
        return 0
    data = json.loads(Path(args.measured).read_text())
    reqs = _measured_requests(data)  # exactly the slice the engine saw
    sim = SimConfig(model=args.model, gpu=args.gpu, tp=args.tp, max_model_len=data.get("max_model_len"),
                    max_num_batched_tokens=data.get("max_num_batched_tokens"), max_num_seqs=data.get("max_num_seqs"),
                    long_prefill_token_threshold=data.get("long_prefill_token_threshold"),
                    enable_prefix_caching=False)
    if args.cmd == "check":
        ttft, itl = simulated_medians(reqs, sim)
        e_t, e_i = ttft / data["ttft_p50_s"] - 1, itl / data["itl_p50_s"] - 1
        print(f"measured TTFT p50 {data['ttft_p50_s']:.4f} s, ITL p50 {data['itl_p50_s']:.4f} s; simulated with the "
              f"{args.gpu} profile: TTFT p50 {ttft:.4f} s ({e_t:+.1%}), ITL p50 {itl:.4f} s ({e_i:+.1%})")
        return 0 if max(abs(e_t), abs(e_i)) <= 0.2 else 1
    t0 = time.perf_counter()
    fit = fit_efficiency(reqs, float(data["ttft_p50_s"]), float(data["itl_p50_s"]), sim,
                         compute=args.compute, memory=args.memory, overhead_s=args.overhead_s)
    default_ttft, default_itl = simulated_medians(reqs, sim)
    out = {"measured": args.measured, "model": args.model, "gpu": args.gpu, "tp": args.tp,
           "measured_ttft_p50_s": data["ttft_p50_s"], "measured_itl_p50_s": data["itl_p50_s"],
           "uncalibrated_ttft_p50_s": default_ttft, "uncalibrated_itl_p50_s": default_itl,
           "fit": {k: getattr(fit, k) for k in ("compute_efficiency", "memory_efficiency", "step_overhead_s",
                                                "ttft_p50_s", "itl_p50_s", "ttft_error", "itl_error")},
           "fit_wall_s": time.perf_counter() - t0}
    Path(str(args.measured).removesuffix(".json") + ".fit.json").write_text(json.dumps(out, indent=2))
    print(f"uncalibrated: TTFT p50 {default_ttft:.4f} s ({default_ttft / data['ttft_p50_s'] - 1:+.1%}), "
          f"ITL p50 {default_itl:.4f} s ({default_itl / data['itl_p50_s'] - 1:+.1%})")
    print(f"compute_efficiency={fit.compute_efficiency:.3f} memory_efficiency={fit.memory_efficiency:.3f} "
          f"step_overhead_s={fit.step_overhead_s:.4f} → TTFT p50 {fit.ttft_p50_s:.4f} s ({fit.ttft_error:+.1%}), "
          f"ITL p50 {fit.itl_p50_s:.4f} s ({fit.itl_error:+.1%})")
    return 0 if fit.max_abs_error <= 0.2 else 1


if __name__ == "__main__":
    sys.exit(main())
