"""Turn a :class:`~.runner.SimResult` into the report ``kvmeter simulate`` prints and writes.

Definitions (all durations in seconds, rates per simulated second):

* TTFT = first token − arrival at the scheduler (queue wait included); ITL = gap between two
  consecutive output tokens of a request, *per token* (percentiles weight every token once; a
  token after a preemption carries the whole gap); TPOT = (last − first token) / (tokens − 1).
* throughput = output tokens generated / simulated span; goodput = output tokens of the completed
  requests that met their tier's TTFT and TPOT objectives / simulated span (DistServe's goodput,
  Zhong et al., OSDI 2024, in tokens); SLO attainment = those requests / all arrived requests.
* service share = a tenant's weighted service (``input_weight·input + output_weight·output``) over
  the total; Jain's index and the service gap are defined in
  :mod:`kvmeter.serving.scheduler.fairness` (rates while backlogged, normalised by tier × tenant
  weight) and :mod:`kvmeter.serving.scheduler.core` (VTC counter spread among backlogged tenants).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kvmeter.serving.scheduler.fairness import jain_index

from .runner import RequestRecord, SimResult

__all__ = ["build_report", "weighted_percentiles", "format_report", "write_report"]

_QS = (50, 95, 99)


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: Sequence[float] = _QS) -> list[float]:
    """Percentiles ``qs`` (0–100) of ``values`` where each value counts ``weights`` times.

    Returns NaN for each q when there are no values. Raises ValueError on mismatched shapes.
    """
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if values.shape != weights.shape:
        raise ValueError("values and weights must have the same shape")
    if values.size == 0 or weights.sum() <= 0:
        return [math.nan] * len(qs)
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    total = cum[-1]
    out = []
    for q in qs:
        idx = int(np.searchsorted(cum, q / 100.0 * total, side="left"))
        out.append(float(v[min(idx, v.size - 1)]))
    return out


def _pcts(xs: Iterable[float]) -> dict[str, float | None]:
    arr = np.asarray([x for x in xs if not math.isnan(x)], dtype=np.float64)
    if arr.size == 0:
        return {f"p{q}": None for q in _QS}
    return {f"p{q}": float(np.percentile(arr, q)) for q in _QS}


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


class _Aggregator:
    def __init__(self, result: SimResult) -> None:
        self.r = result
        self.seg_t = [np.asarray(s, dtype=np.float64) for s in result.seg_t]
        self.seg_k = [np.asarray(s, dtype=np.float64) for s in result.seg_k]
        self.span = max(result.sim_end_s, 1e-9)
        cfg = result.scheduler_config
        self.tiers = cfg.tiers
        self.cfg = cfg

    def slo_met(self, rec: RequestRecord) -> bool:
        pol = self.cfg.tier(rec.tier)
        if rec.outcome != "ok":
            return False
        ttft = rec.first_token_s - rec.arrival_s
        tpot = (rec.finish_s - rec.first_token_s) / (rec.generated - 1) if rec.generated > 1 else 0.0
        return pol.meets_slo(ttft, tpot)

    def itl(self, recs: Sequence[RequestRecord]) -> list[float]:
        vals: list[np.ndarray] = []
        wts: list[np.ndarray] = []
        gaps: list[float] = []
        for rec in recs:
            if rec.replica < 0:
                continue
            st, sk = self.seg_t[rec.replica], self.seg_k[rec.replica]
            for a, b in rec.spans:
                vals.append(st[a:b + 1])
                wts.append(sk[a:b + 1])
            gaps.extend(rec.gap_itls)
        if gaps:
            vals.append(np.asarray(gaps))
            wts.append(np.ones(len(gaps)))
        if not vals:
            return [math.nan] * len(_QS)
        return weighted_percentiles(np.concatenate(vals), np.concatenate(wts))

    def group(self, recs: Sequence[RequestRecord], service: float, total_service: float) -> dict:
        done = [r for r in recs if r.outcome == "ok"]
        rejected: dict[str, int] = defaultdict(int)
        dropped: dict[str, int] = defaultdict(int)
        for r in recs:
            if r.outcome == "rejected":
                rejected[r.reason] += 1
            elif r.outcome == "dropped":
                dropped[r.reason] += 1
        good = [r for r in done if self.slo_met(r)]
        itl = self.itl(done)
        out_tokens = sum(r.generated for r in done)
        return {
            "requests": len(recs), "completed": len(done),
            "rejected": dict(rejected), "dropped": dict(dropped),
            "input_tokens": sum(r.input_tokens for r in done),
            "cached_input_tokens": sum(r.cached_tokens for r in done),
            "output_tokens": out_tokens,
            "service": _round(service, 1),
            "service_share": _round(service / total_service if total_service else 0.0, 5),
            "throughput_output_tokens_per_s": _round(out_tokens / self.span, 2),
            "goodput_output_tokens_per_s": _round(sum(r.generated for r in good) / self.span, 2),
            "goodput_requests_per_s": _round(len(good) / self.span, 4),
            "slo_attainment": _round(len(good) / len(recs) if recs else 1.0, 4),
            "ttft_s": {k: _round(v) for k, v in _pcts(r.first_token_s - r.arrival_s for r in done).items()},
            "itl_s": {f"p{q}": _round(v) for q, v in zip(_QS, itl, strict=True)},
            "tpot_s": {k: _round(v) for k, v in _pcts(
                (r.finish_s - r.first_token_s) / (r.generated - 1) for r in done if r.generated > 1).items()},
            "e2e_s": {k: _round(v) for k, v in _pcts(r.finish_s - r.arrival_s for r in done).items()},
            "queue_wait_s": {k: _round(v) for k, v in _pcts(r.dispatch_s - r.arrival_s for r in done).items()},
            "preemptions": sum(r.preemptions for r in recs),
        }


def build_report(result: SimResult, *, trace: str = "", policy_label: str | None = None) -> dict:
    """The full report as plain data (JSON-serialisable).

    Args:
        result: a finished simulation.
        trace: trace label for the header.
        policy_label: the policy as the report names it (default the policy's own name; a
            baseline with a kvmeter mechanism added says so, e.g. ``fcfs+kv-budget``).
    """
    agg = _Aggregator(result)
    recs = result.records
    svc = result.tenant_service
    total_service = sum(svc.values())
    by_tier: dict[str, list[RequestRecord]] = defaultdict(list)
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in recs:
        by_tier[r.tier].append(r)
        by_tenant[r.tenant_id].append(r)
    tier_of = {t: rs[0].tier for t, rs in by_tenant.items()}
    rates = {t: x for t, x in result.backlogged_rates.items()}
    # the meter already normalises by tenant × tier weight; restrict to enough backlogged time
    eligible = {t: x for t, x in rates.items() if t in tier_of}
    jain_all = jain_index(eligible.values()) if eligible else 1.0
    tiers_out = {}
    for tier, rs in sorted(by_tier.items()):
        tier_service = sum(svc.get(t, 0.0) for t in {r.tenant_id for r in rs})
        g = agg.group(rs, tier_service, total_service)
        members = {t: x for t, x in eligible.items() if tier_of.get(t) == tier}
        g["jain_index"] = _round(jain_index(members.values()) if members else 1.0, 4)
        pol = result.scheduler_config.tier(tier)
        g["slo"] = {"ttft_s": pol.ttft_slo_s, "itl_s": pol.itl_slo_s, "weight": pol.weight,
                    "priority": pol.priority}
        tiers_out[tier] = g
    tenants_out = {}
    for tenant, rs in sorted(by_tenant.items(), key=lambda kv: -svc.get(kv[0], 0.0)):
        g = agg.group(rs, svc.get(tenant, 0.0), total_service)
        g["tier"] = tier_of[tenant]
        g["backlogged_service_rate"] = _round(rates.get(tenant), 3)
        tenants_out[tenant] = g
    overall = agg.group(recs, total_service, total_service)
    q, h = result.prefix_queries_tokens, result.prefix_hits_tokens
    return {
        "meta": {
            "trace": trace, "policy": policy_label or result.policy, "sim": dataclasses.asdict(result.sim_config),
            "cost_model": result.cost, "sim_span_s": _round(result.sim_end_s, 2),
            "wall_s": _round(result.wall_s, 2), "requests": len(recs), "tenants": len(by_tenant),
        },
        "overall": {
            **overall,
            "jain_index": _round(jain_all, 4),
            "jain_tenants": len(eligible),
            "max_service_gap": _round(result.max_service_gap, 1),
            "prefix_cache_hit_ratio": _round(h / q if q else 0.0, 4),
            "kv_watermark_mean": [_round(x) for x in result.kv_watermark_mean],
            "kv_watermark_max": [_round(x) for x in result.kv_watermark_max],
            "max_queued": max((s.queued_total for s in result.samples), default=0),
            "scheduler_rejected": result.rejected_total, "scheduler_dropped": result.dropped_total,
        },
        "tiers": tiers_out,
        "tenants": tenants_out,
    }


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_report(report: dict, *, top_tenants: int = 10) -> str:
    """A human-readable summary (tiers, then the tenants with the most service)."""
    m, o = report["meta"], report["overall"]
    lines = [
        f"kvmeter simulate — trace {m['trace'] or '-'} · policy {m['policy']} · {m['sim']['model']} on "
        f"{m['sim']['replicas']}× {m['sim']['tp']}×{m['sim']['gpu']} · {m['requests']} requests, "
        f"{m['tenants']} tenants · {m['sim_span_s']} s simulated in {m['wall_s']} s",
        f"throughput {_fmt(o['throughput_output_tokens_per_s'])} out tok/s · goodput "
        f"{_fmt(o['goodput_output_tokens_per_s'])} out tok/s · SLO attainment {_fmt(o['slo_attainment'])} · "
        f"Jain {_fmt(o['jain_index'])} ({o['jain_tenants']} backlogged tenants) · max service gap "
        f"{_fmt(o['max_service_gap'])} · preemptions {o['preemptions']} · prefix hits "
        f"{_fmt(o['prefix_cache_hit_ratio'])} · KV mean {o['kv_watermark_mean']}",
        f"rejected {o['rejected'] or {}} · dropped {o['dropped'] or {}} · max queued {o['max_queued']}",
        "",
    ]
    head = (f"{'group':<22}{'reqs':>7}{'done':>7}{'rej':>6}{'drop':>6}{'share':>8}{'TTFT p50':>10}"
            f"{'p95':>8}{'p99':>8}{'ITL p50':>9}{'p95':>8}{'p99':>8}{'goodput':>9}{'SLO':>7}")
    lines.append(head)
    lines.append("-" * len(head))

    def row(name: str, g: dict) -> str:
        return (f"{name[:21]:<22}{g['requests']:>7}{g['completed']:>7}{sum(g['rejected'].values()):>6}"
                f"{sum(g['dropped'].values()):>6}{_fmt(g['service_share']):>8}"
                f"{_fmt(g['ttft_s']['p50']):>10}{_fmt(g['ttft_s']['p95']):>8}{_fmt(g['ttft_s']['p99']):>8}"
                f"{_fmt(g['itl_s']['p50']):>9}{_fmt(g['itl_s']['p95']):>8}{_fmt(g['itl_s']['p99']):>8}"
                f"{_fmt(g['goodput_output_tokens_per_s']):>9}{_fmt(g['slo_attainment']):>7}")

    for tier, g in report["tiers"].items():
        lines.append(row(f"tier {tier}", g))
    lines.append("")
    for tenant, g in list(report["tenants"].items())[:top_tenants]:
        lines.append(row(tenant, g))
    return "\n".join(lines)


def write_report(report: dict, out_prefix: str | Path) -> list[Path]:
    """Write ``<prefix>.json`` (everything) and ``<prefix>.csv`` (one row per tier and tenant).

    Returns:
        the paths written. Raises OSError if the folder cannot be written.
    """
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    jpath = prefix.with_suffix(".json")
    jpath.write_text(json.dumps(report, indent=2, sort_keys=False))
    cpath = prefix.with_suffix(".csv")
    fields = ["kind", "name", "tier", "requests", "completed", "rejected", "dropped", "service_share",
              "input_tokens", "output_tokens", "throughput_output_tokens_per_s",
              "goodput_output_tokens_per_s", "slo_attainment", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
              "itl_p50_s", "itl_p95_s", "itl_p99_s", "tpot_p50_s", "queue_wait_p95_s", "jain_index"]
    with cpath.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for kind, items in (("tier", report["tiers"].items()), ("tenant", report["tenants"].items())):
            for name, g in items:
                w.writerow({
                    "kind": kind, "name": name, "tier": g.get("tier", name), "requests": g["requests"],
                    "completed": g["completed"], "rejected": sum(g["rejected"].values()),
                    "dropped": sum(g["dropped"].values()), "service_share": g["service_share"],
                    "input_tokens": g["input_tokens"], "output_tokens": g["output_tokens"],
                    "throughput_output_tokens_per_s": g["throughput_output_tokens_per_s"],
                    "goodput_output_tokens_per_s": g["goodput_output_tokens_per_s"],
                    "slo_attainment": g["slo_attainment"], "ttft_p50_s": g["ttft_s"]["p50"],
                    "ttft_p95_s": g["ttft_s"]["p95"], "ttft_p99_s": g["ttft_s"]["p99"],
                    "itl_p50_s": g["itl_s"]["p50"], "itl_p95_s": g["itl_s"]["p95"],
                    "itl_p99_s": g["itl_s"]["p99"], "tpot_p50_s": g["tpot_s"]["p50"],
                    "queue_wait_p95_s": g["queue_wait_s"]["p95"], "jain_index": g.get("jain_index")})
    return [jpath, cpath]
