"""Tool-policy evaluation benchmark: 1,000 rules, per tool and per request, and its share of the
gateway's CPU per request.

The policy (issue 12: "policy evaluation with 1,000 rules ≤ 50 µs p99 per request"): one API key
whose chain org → workspace → project → key carries 1,000 rules — org: 300 block patterns (150
exact names, 150 globs) and 100 risk globs; workspace: an allow list of 200 patterns; project: 200
risk entries (exact and glob); key: 200 block names — compiled once by the tenant directory.

Measured, in one run:

* **compile**: loading the config (pydantic validation + compiling every node's patterns).
* **per tool, cold**: :meth:`ToolPolicy.evaluate_uncached` on 20,000 distinct tool names (a third
  blocked, a third not allowed, a third allowed with a class), each timed alone (``perf_counter_ns``):
  p50 / p99 / max. Cold = no memo: every name is new.
* **per tool, warm**: :meth:`ToolPolicy.evaluate` (the memo the gateway uses) on 50 names an agent
  repeats.
* **per request, cold**: a request declaring 8 tools (:meth:`AgentRuns.check_declared_tools`' policy
  part: 8 evaluations) — p99; and one tool-call report's whole policy part (``evaluate`` + the
  argument digest of a 200-byte object).
* **share of gateway CPU** (``--gateway``): ``kvmeter serve --engine instant`` as a real process
  (memory quota store, chDB ledger) answering N chat completions and N tool-call reports over
  loopback, its CPU time read from ``/proc/<pid>/stat`` (server only, not the client): CPU per chat
  request and per report, and the policy evaluation's share of each.

Usage::

    .venv/bin/python bench/agents/bench_policy.py [--gateway] [--n 2000] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmeter.serving.agents import arguments_digest
from kvmeter.serving.tenancy import TenantDirectory

RULES = 1_000
TOOLS = 20_000


def _name(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def config_yaml(seed: int = 12) -> tuple[str, list[str]]:
    """The 1,000-rule tenants config and a list of tool names exercising every path."""
    rng = random.Random(seed)
    words = [_name(rng, 8) for _ in range(400)]
    org_block = [f"{w}_exec" for w in words[:150]] + [f"{w[:3]}*_danger" for w in words[150:300]]
    org_risk = {f"{w[:4]}*": rng.choice(["read_only", "side_effect", "high_risk"]) for w in words[:100]}
    allow = [f"{w[:5]}*" for w in words[:150]] + [f"{w}_tool" for w in words[300:350]]
    proj_risk = {**{f"{w}_tool": "side_effect" for w in words[300:400]},
                 **{f"*_{w[:4]}": "high_risk" for w in words[:100]}}
    key_block = [f"{w}_legacy" for w in words[200:400]]
    n = len(org_block) + len(org_risk) + len(allow) + len(proj_risk) + len(key_block)
    assert n == RULES, n

    def lst(xs: list[str]) -> str:
        return "[" + ", ".join(json.dumps(x) for x in xs) + "]"

    def mp(d: dict[str, str]) -> str:
        return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"

    text = f"""version: 1
orgs:
  acme:
    tier: enterprise
    limits: {{requests_per_minute: null, input_tokens_per_minute: null, output_tokens_per_minute: null}}
    tool_policy: {{block: {lst(org_block)}, risk: {mp(org_risk)}, default_risk: side_effect}}
    workspaces:
      w:
        tool_policy: {{allow: {lst(allow)}}}
        projects:
          p:
            tool_policy: {{risk: {mp(proj_risk)}}}
            api_keys:
              k: {{key: sk-bench-agent-0001, limits: {{requests_per_minute: null}},
                  tool_policy: {{block: {lst(key_block)}}}}}
"""
    tools: list[str] = []
    for i in range(TOOLS):
        w = rng.choice(words)
        kind = i % 3
        if kind == 0:  # blocked (exact or glob at the org, or the key's names)
            tools.append(rng.choice([f"{w}_exec", f"{w[:3]}x{i}_danger", f"{w}_legacy"]))
        elif kind == 1:  # allowed by a glob, classified somewhere (or by default)
            tools.append(f"{w[:5]}{_name(rng, 6)}{i}")
        else:  # matches nothing of the allow list
            tools.append(f"zz{_name(rng, 10)}{i}")
    return text, tools


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed_ns(fn, items) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for x in items:
        t0 = clock()
        fn(x)
        out.append((clock() - t0) / 1000.0)
    return out


def bench_policy() -> dict:
    text, tools = config_yaml()
    t0 = time.perf_counter()
    directory = TenantDirectory(text)
    compile_s = time.perf_counter() - t0
    policy = directory.snapshot.keys["k"].tool_policy
    verdicts = [policy.evaluate_uncached(t) for t in tools]
    outcome = {"blocked": sum(v.code == "tool_blocked" for v in verdicts),
               "not_allowed": sum(v.code == "tool_not_allowed" for v in verdicts),
               "allowed": sum(v.allowed for v in verdicts)}
    for _ in range(2):  # warm the interpreter's caches (not the policy's memo)
        timed_ns(policy.evaluate_uncached, tools[:2000])
    cold = timed_ns(policy.evaluate_uncached, tools)
    hot_names = tools[:50]
    for t in hot_names:
        policy.evaluate(t)
    warm = timed_ns(policy.evaluate, hot_names * 400)
    groups = [tools[i:i + 8] for i in range(0, len(tools) - 8, 8)]
    per_request = timed_ns(lambda g: [policy.evaluate_uncached(t) for t in g], groups)
    args = {"query": "kv cache watermark", "limit": 20, "filters": {"tenant": "acme", "since": "2026-11-01"},
            "fields": ["id", "title", "score"], "note": "x" * 60}
    report = timed_ns(lambda t: (policy.evaluate_uncached(t), arguments_digest(args)), tools[:5000])

    def stats(xs: list[float]) -> dict:
        return {"p50_us": round(statistics.median(xs), 2), "p99_us": round(percentile(xs, 0.99), 2),
                "max_us": round(max(xs), 1), "n": len(xs)}

    return {"rules": RULES, "compile_s": round(compile_s, 3), "outcomes": outcome,
            "per_tool_cold": stats(cold), "per_tool_warm": stats(warm), "per_request_8_tools_cold": stats(per_request),
            "per_report_policy_and_digest_cold": stats(report)}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_gateway(n: int) -> dict:
    """CPU of a real ``kvmeter serve --engine instant`` per chat request and per tool-call report."""
    import httpx

    from kvmeter.net import free_port

    text, tools = config_yaml()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tenants.yaml").write_text(text)
        port = free_port()
        kvmeter = Path(sys.executable).with_name("kvmeter")
        proc = subprocess.Popen([str(kvmeter), "--log-level", "WARNING", "serve", "--engine", "instant",
                                 "--port", str(port), "--tenants", str(root / "tenants.yaml"),
                                 "--ledger-dsn", f"chdb://{root}/chdb", "--spool-dir", str(root / "spool")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:  # waiting for the process to come up, not timing logic
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.3)
            h = {"authorization": "Bearer sk-bench-agent-0001"}
            model = httpx.get(url + "/v1/models", headers=h).json()["data"][0]["id"]
            with httpx.Client(base_url=url, timeout=30) as c:
                chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
                for _ in range(50):  # warm-up
                    c.post("/v1/chat/completions", headers=h, json=chat)
                cpu0 = _cpu_s(proc.pid)
                for _ in range(n):
                    r = c.post("/v1/chat/completions", headers=h, json=chat)
                    assert r.status_code == 200, r.text
                cpu_chat = (_cpu_s(proc.pid) - cpu0) / n
                allowed = [t for t in tools if t.startswith(tuple("abcdefghijklmnopqrstuvwxy"))][:n]
                cpu0 = _cpu_s(proc.pid)
                codes: dict[int, int] = {}
                for i in range(n):
                    r = c.post(f"/v1/agent_runs/run-{i}/tool_calls", headers=h,
                               json={"tool": allowed[i % len(allowed)], "arguments": {"i": i}})
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                cpu_report = (_cpu_s(proc.pid) - cpu0) / n
        finally:
            proc.terminate()
            proc.wait(60)
    return {"n": n, "cpu_per_chat_request_us": round(cpu_chat * 1e6, 1),
            "cpu_per_tool_call_report_us": round(cpu_report * 1e6, 1), "report_status_codes": codes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", action="store_true", help="also measure kvmeter serve's CPU per request")
    ap.add_argument("--n", type=int, default=2000, help="requests per gateway measurement")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    a = ap.parse_args()
    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(),
           "cpus": os.cpu_count(), "load_start": os.getloadavg(), "policy": bench_policy()}
    if a.gateway:
        g = out["gateway"] = bench_gateway(a.n)
        p = out["policy"]
        g["policy_share_of_chat_request_cpu"] = round(p["per_tool_cold"]["p50_us"] / g["cpu_per_chat_request_us"], 4)
        g["policy_share_of_report_cpu"] = round(p["per_tool_cold"]["p50_us"] / g["cpu_per_tool_call_report_us"], 4)
    out["load_end"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
