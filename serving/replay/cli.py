"""``kvmeter replay`` — replay a real trace against a running gateway as several tenants.

Example::

    kvmeter replay --server http://127.0.0.1:8000 --trace azure-code --requests 500 \\
        --tenant acme=sk-...:3 --tenant umbrella=sk-...:1:noisy

Each ``--tenant NAME=KEY[:SHARE][:noisy]`` adds a tenant (share of requests, default 1; ``noisy``
gives it long prompts). Without ``--tenant``, the demo tenants are used. The scaling rule is
documented in :mod:`kvmeter.serving.replay.plan`. Results per request go to ``--out`` (CSV).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import sys
from pathlib import Path

from kvmeter.cliargs import http_url as _server_url, positive_int as _positive_int

__all__ = ["add_arguments", "run", "parse_tenant", "served_model"]


def served_model(server: str, api_key: str, *, timeout_s: float = 10.0, transport=None) -> str:  # noqa: ANN001
    """The first model ``GET {server}/v1/models`` lists.

    Raises:
        ValueError: the server cannot be reached, refused the key or answered something else;
            the message names the URL.
    """
    import httpx

    url = f"{server}/v1/models"
    try:
        with httpx.Client(timeout=timeout_s, transport=transport) as client:
            response = client.get(url, headers={"authorization": f"Bearer {api_key}"})
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        try:
            detail = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            detail = response.text[:200]
        raise ValueError(f"GET {url} answered {response.status_code}: {detail} "
                         "(pass --model, or a --tenant key this server knows)")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {url} did not list a model (pass --model)") from None


def parse_tenant(spec: str):
    """``NAME=KEY[:SHARE][:noisy]`` → ReplayTenant. Raises ValueError naming the problem."""
    from kvmeter.serving.replay.plan import ReplayTenant

    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--tenant {name or spec!r}: expected NAME=KEY[:SHARE][:noisy]")
    parts = rest.split(":")
    key, share, noisy = parts[0], 1.0, False
    for part in parts[1:]:
        if part == "noisy":
            noisy = True
        else:
            try:
                share = float(part)
            except ValueError:
                raise ValueError(f"--tenant {name}: share {part!r} is not a number") from None
    return ReplayTenant(name, key, share, noisy)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, type=_server_url,
                        help="gateway base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name (default: the server's /v1/models)")
    parser.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake or a path")
    parser.add_argument("--requests", type=_positive_int, default=300,
                        help="requests from the trace's start (≥ 1, default 300)")
    parser.add_argument("--tenant", action="append", default=[], help="NAME=KEY[:SHARE][:noisy] (repeat)")
    parser.add_argument("--time-compression", type=float, default=2.0)
    parser.add_argument("--token-scale", type=float, default=1 / 8)
    parser.add_argument("--noisy-input-tokens", "--noisy-prompt-tokens", type=_positive_int, default=4096,
                        help="input tokens of each noisy tenant's request (default 4096; "
                             "--noisy-prompt-tokens is the old spelling)")
    parser.add_argument("--model-dir", help="tokenizer directory (default: the bundled model)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", help="write per-request results to this CSV")


def run(args: argparse.Namespace) -> int:
    from kvmeter.model import ModelError, resolve_model
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.replay.client import replay
    from kvmeter.serving.replay.plan import DEMO_TENANTS, ReplayTenant, ScalingRule, build_plan
    from kvmeter.serving.replay.prompts import PromptSynthesizer
    from kvmeter.traces import TraceError, load_trace

    try:
        tenants = [parse_tenant(t) for t in args.tenant] or [ReplayTenant(*t) for t in DEMO_TENANTS]
        rule = ScalingRule(time_compression=args.time_compression, token_scale=args.token_scale,
                           noisy_input_tokens=args.noisy_input_tokens)
        if args.out and not Path(args.out).absolute().parent.is_dir():
            raise ValueError(f"--out {args.out}: no such directory {Path(args.out).absolute().parent}")
        trace = load_trace(args.trace, limit=args.requests)
        if not trace:
            raise ValueError(f"trace {args.trace} has no requests")
        model_dir = args.model_dir or resolve_model(None)[0]
        model = args.model or served_model(args.server, tenants[0].api_key)
    except (ValueError, TraceError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    synth = PromptSynthesizer(HFTokenizer(model_dir), seed=args.seed)
    rule = dataclasses.replace(rule, min_input_tokens=synth.overhead + 1)
    plan = build_plan(trace, tenants, rule, seed=args.seed)
    results = asyncio.run(replay(args.server, model, plan,
                                 lambda r: synth.messages(r.input_tokens, seed=args.seed * 100_003 + r.index)))
    ok = sum(r.status == 200 and not r.error for r in results)
    print(f"{ok}/{len(results)} requests completed")
    if not ok and results:
        print(f"error: no request completed; the first: {results[0].error or results[0].status}", file=sys.stderr)
    if args.out:
        try:
            with open(args.out, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=[f.name for f in dataclasses.fields(results[0])])
                writer.writeheader()
                writer.writerows(dataclasses.asdict(r) for r in results)
        except OSError as exc:
            print(f"error: cannot write --out {args.out}: {exc}", file=sys.stderr)
            return 2
    return 0 if ok else 1
