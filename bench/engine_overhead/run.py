"""kvmeter serve vs vLLM's own OpenAI server: same model, same engine settings, same load, one run.

Starts ``vllm serve`` (vLLM's OpenAI server) and ``kvmeter serve`` one after the other on the same
model directory with the same engine settings, sends each the same closed-loop load (fixed prompts
of exact token length, outputs held to a fixed length with min_tokens = max_tokens, streaming), and
reports output-token throughput and TTFT/ITL percentiles side by side, with kvmeter's ratio.

    .venv/bin/python bench/engine_overhead/run.py --requests 96 --concurrency 16 --rounds 2

Targets (issue 2): kvmeter's output-token throughput ≥ 95 % of vLLM's; added TTFT p99 ≤ 10 ms.
The servers alternate (vLLM, kvmeter, vLLM, kvmeter, ...) for ``--rounds`` rounds to spread drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvmeter.serving.demo import stop_server

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
#: the demo's batch tenant: no quota limits and a 600 s TTFT objective, so kvmeter's overload control
#: refuses nothing and both servers do the same work (an enterprise key's 3 s deadline would make
#: kvmeter refuse early what 16 concurrent requests on 2 cores cannot start in time)
KEY = "sk-demo-initech-0001"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def loadavg() -> float:
    """The 1-minute load average (recorded per round: the machine is shared)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def start(kind: str, model_dir: Path, name: str, port: int, args: argparse.Namespace,
          workdir: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "TOKENIZERS_PARALLELISM": "false"}
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if kind == "vllm":
        # (``vllm serve`` itself looks up the distribution "vllm", which vllm-cpu does not provide;
        # the module it runs is the same OpenAI server)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--port", str(port),
               "--host", "127.0.0.1", "--enable-prefix-caching", "--scheduling-policy", "priority",
               "--seed", "0", *common]
    else:
        cmd = [str(VENV_BIN / "kvmeter"), "serve", "--port", str(port), "--scheduler", args.scheduler,
               "--kv-cache-gib", str(args.kv_gib), "--ledger-dsn", f"chdb://{workdir}/ledger",
               "--spool-dir", str(workdir / "spool"), *common]
    log = open(workdir / f"{kind}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = "\n  ".join(log_path.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"server exited with {proc.returncode}:\n  {tail}")
        try:
            r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=2)
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


async def load(url: str, name: str, prompts: list[list[dict]], out_tokens: int, concurrency: int) -> dict:
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    errors = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> None:
        nonlocal tokens, errors
        body = {"model": name, "messages": messages, "max_tokens": out_tokens, "min_tokens": out_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            last = None
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {KEY}"}) as resp:
                if resp.status_code != 200:
                    errors += 1
                    await resp.aread()
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
                    elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            ttfts.append(now - t0)
                        else:
                            itls.append(now - last)
                        last = now

    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, m) for m in prompts))
        wall = time.perf_counter() - t0
    return {"output_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "errors": errors,
            "ttft_p50_ms": 1000 * pct(ttfts, 50), "ttft_p99_ms": 1000 * pct(ttfts, 99),
            "itl_p50_ms": 1000 * pct(itls, 50), "itl_p99_ms": 1000 * pct(itls, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-tokens", "--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--scheduler", choices=["vtc", "fcfs"], default="vtc")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from kvmeter.model import resolve_model
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.prompts import PromptSynthesizer

    model_dir, name = resolve_model(None)
    synth = PromptSynthesizer(HFTokenizer(model_dir), seed=11)
    prompts = [synth.messages(args.input_tokens, seed=i) for i in range(args.requests)]
    results: dict[str, list[dict]] = {"vllm": [], "kvmeter": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for kind in ("vllm", "kvmeter"):
                workdir = Path(tmp) / f"{kind}-{rnd}"
                workdir.mkdir()
                url = f"http://127.0.0.1:{args.port}"
                proc = start(kind, model_dir, name, args.port, args, workdir)
                try:
                    ready = wait_ready(proc, url, workdir / f"{kind}.log")
                    asyncio.run(load(url, name, prompts[:8], args.output_tokens, args.concurrency))  # warm-up
                    load_start = loadavg()
                    res = asyncio.run(load(url, name, prompts, args.output_tokens, args.concurrency))
                    res["startup_s"] = ready
                    res["load_1m_start"], res["load_1m_end"] = load_start, loadavg()
                    results[kind].append(res)
                    print(f"round {rnd} {kind:8s} " + " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
                finally:
                    stop_server(proc)

    summarize(results, args, throughput="output_tok_s", p50="ttft_p50_ms", p99="ttft_p99_ms")
    return 0


def summarize(results: dict, args: argparse.Namespace, *, throughput: str, p50: str, p99: str,
              kind: str = "kvmeter") -> None:
    """Print ``kind``'s throughput ratio and added TTFT over vLLM's (means over rounds) and write
    ``args.json`` when given (every kind's results; ratios keyed by kind when ``kind`` is not
    "kvmeter"); ``throughput``/``p50``/``p99`` name the result keys (tok/s, ms)."""
    def mean(k: str, key: str) -> float:
        return statistics.fmean(r[key] for r in results[k])

    ratio = mean(kind, throughput) / mean("vllm", throughput)
    added_p99 = mean(kind, p99) - mean("vllm", p99)
    added_p50 = mean(kind, p50) - mean("vllm", p50)
    print(f"\nthroughput ratio {kind}/vLLM = {ratio:.3f}   added TTFT p50 = {added_p50:+.1f} ms   "
          f"added TTFT p99 = {added_p99:+.1f} ms")
    if args.json:
        path = Path(args.json)
        doc = json.loads(path.read_text()) if kind != "kvmeter" and path.exists() else {}
        doc.update(args=vars(args), results=results)
        if kind == "kvmeter":
            doc.update(ratio=ratio, added_ttft_p99_ms=added_p99)
        else:
            doc.setdefault("variants", {})[kind] = {"ratio": ratio, "added_ttft_p99_ms": added_p99}
        path.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    sys.exit(main())
