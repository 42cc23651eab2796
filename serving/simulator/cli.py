"""``kvmeter simulate`` — replay a real trace on simulated GPU replicas under a scheduling policy.

Examples::

    kvmeter simulate --trace azure-conv --policy vtc --model llama-3.1-70b --gpu h200 --tp 4
    kvmeter simulate --trace mooncake --policy fcfs --replicas 2 --duration-s 600
    kvmeter simulate --trace mooncake --replicas 4 --routing prefix_aware
    kvmeter simulate --trace my.csv --tenants column --out results/run1

Tenants: ``servegen`` (default) splits the trace's requests over ServeGen clients (see
:mod:`.tenants`); ``single`` puts everything on one tenant; ``column`` uses the trace's own
``tenant_id``/``tier`` columns. The report (per tier and per tenant: service share, TTFT/ITL
percentiles, goodput, throughput, shed and rejected by reason, Jain's index, max service gap) is
printed and written to ``<out>.json`` and ``<out>.csv`` (default ``var/sim/kvmeter-sim-<trace>-<policy>``
under the current directory: in a checkout, the git-ignored ``var/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from kvmeter.cliargs import non_negative_int as _non_negative_int, positive_int as _positive_int
from kvmeter.serving.scheduler.config import SchedulerConfig
from kvmeter.serving.scheduler.policy import POLICIES
from kvmeter.serving.scheduler.router import ROUTING_POLICIES
from kvmeter.traces import REQUEST_TRACES, TraceError, load_trace

from .hardware import ACCELERATORS
from .models import MODELS
from .report import build_report, format_report, write_report
from .runner import SimConfig, Simulation
from .tenants import ServeGenTenantMap, load_servegen_rates

#: Where the report goes without ``--out``, relative to the current directory (``var/`` is
#: git-ignored in a checkout, as the demo's runs and the tests' screenshots are).
DEFAULT_OUT_DIR = Path("var") / "sim"

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def _tier_map_arg(text: str) -> dict[str, str]:
    """argparse type of ``--tier-map``: inline JSON (``{"sg-1": "enterprise"}``) or the path of a
    JSON file holding such an object. Returns tenant id → tier name.

    Raises:
        argparse.ArgumentTypeError: neither valid inline JSON nor a readable JSON file, or JSON
            that is not an object of strings.
    """
    source = "inline JSON"
    body = text
    if not text.lstrip().startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither a JSON object (e.g. '{{\"sg-1\": \"enterprise\"}}') nor an existing JSON file")
        source = str(path)
        try:
            body = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {source}: {exc}") from None
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{source} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise argparse.ArgumentTypeError(f"{source}: a tier map must be a JSON object of tenant id → tier name")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``kvmeter simulate``'s flags on ``parser``."""
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", default="azure-conv",
                   help=f"trace name ({', '.join(REQUEST_TRACES)}) or a file path (default azure-conv)")
    g.add_argument("--duration-s", type=float, default=None, help="replay only this many trace seconds")
    g.add_argument("--start-s", type=float, default=0.0, help="offset into the trace (seconds)")
    g.add_argument("--limit", type=_positive_int, default=None, help="replay at most this many requests (≥ 1)")
    g.add_argument("--rate-scale", type=float, default=1.0,
                   help="compress arrivals by this factor (2 = twice the request rate)")
    g.add_argument("--tenants", choices=("servegen", "single", "column"), default="servegen",
                   help="how requests map to tenants (default servegen)")
    g.add_argument("--servegen-start", type=int, default=None,
                   help="ServeGen offset (s) mapped to trace t=0 (default: its busiest hour)")
    g.add_argument("--tier-map", type=_tier_map_arg, default=None, metavar="JSON|FILE",
                   help='tenant id → tier, as inline JSON (\'{"sg-1": "enterprise"}\') or the path of a JSON '
                        "file holding that object (--tenants servegen)")
    g.add_argument("--tier", default="paid_interactive", help="tier of the single tenant (--tenants single)")
    g.add_argument("--seed", type=int, default=0, help="seed of the tenant draws")
    s = parser.add_argument_group("scheduler")
    s.add_argument("--policy", choices=POLICIES, default="vtc", help="dispatch policy (default vtc)")
    s.add_argument("--rpm-limit", type=float, default=None, help="requests/minute per tenant (rpm policy)")
    s.add_argument("--kv-budget-ratio", type=float, default=None,
                   help="per-tenant active-KV budget as a fraction of KV capacity (default 0.5)")
    s.add_argument("--no-overload-control", action="store_true",
                   help="no deadlines, pressure levels or shedding (default: on for vtc, off for baselines)")
    s.add_argument("--overload-control", action="store_true", help="force overload control on")
    s.add_argument("--no-adaptive-limit", action="store_true",
                   help="no adaptive engine running limit (default: on with overload control)")
    e = parser.add_argument_group("deployment")
    e.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-70b")
    e.add_argument("--gpu", choices=sorted(ACCELERATORS), default="h200")
    e.add_argument("--tp", type=int, default=4, help="tensor-parallel degree per replica (default 4)")
    e.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    e.add_argument("--routing", choices=ROUTING_POLICIES, default=None,
                   help="the replica choice, as serve's engine pool (default: the most free KV, no router)")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    e.add_argument("--max-num-seqs", type=_positive_int, default=None)
    e.add_argument("--long-prefill-threshold", type=int, default=None,
                   help="most prefill tokens per request per step (default: no cap)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--compute-efficiency", type=float, default=None,
                   help="fraction of peak FLOP/s for the whole step; giving it (or --memory-efficiency) "
                        "replaces the GPU operator calibration with the plain roofline")
    e.add_argument("--memory-efficiency", type=float, default=None,
                   help="fraction of peak memory bandwidth for the whole step (plain roofline, as above)")
    e.add_argument("--step-overhead-s", type=float, default=None, help="fixed seconds per engine step")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default=None,
                   help=f"output prefix (default {DEFAULT_OUT_DIR}/kvmeter-sim-<trace>-<policy>, "
                        "under the current directory)")
    o.add_argument("--top-tenants", type=_non_negative_int, default=10, help="tenants listed in the printed report")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workload(args: argparse.Namespace):
    reqs = load_trace(args.trace, duration_s=args.duration_s, limit=args.limit, start_s=args.start_s)
    if not reqs:
        window = f"--start-s {args.start_s}"
        if args.duration_s is not None:
            window += f" --duration-s {args.duration_s}"
        raise ValueError(f"the trace slice is empty: no requests in {args.trace} with {window} "
                         "(check them against the trace's length)")
    if args.rate_scale != 1.0:
        if not args.rate_scale > 0:
            raise ValueError("--rate-scale must be > 0")
        reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / args.rate_scale) for r in reqs]
    if args.tenants == "single":
        return [dataclasses.replace(r, tenant_id="tenant-0", tier=args.tier) for r in reqs]
    if args.tenants == "column":
        return reqs
    mapper = ServeGenTenantMap(load_servegen_rates(), start_s=args.servegen_start, seed=args.seed,
                               tier_map=args.tier_map)
    return mapper.assign(reqs)


def scheduler_config(args: argparse.Namespace) -> tuple[SchedulerConfig, str]:
    """The scheduler configuration of the flags, and the policy's label for the report.

    ``vtc`` runs kvmeter's defaults (:class:`SchedulerConfig`): overload control, the adaptive
    engine limit, KV and prefill budgets. The baselines (``fcfs``, ``rpm``) run
    :meth:`SchedulerConfig.plain_baseline` — a plain deployment, none of those. A flag that adds a
    kvmeter mechanism to a baseline (``--overload-control``, ``--kv-budget-ratio``) names it in
    the label (``fcfs+overload-control``, ``fcfs+kv-budget``), so no report calls FCFS what is not.

    Raises:
        ValueError: a value the configuration refuses.
    """
    baseline = args.policy != "vtc"
    control = not baseline
    if args.no_overload_control:
        control = False
    if args.overload_control:
        control = True
    changes: dict = {"overload_control": control,
                     "adaptive_engine_limit": control and not args.no_adaptive_limit}
    if args.rpm_limit is not None:
        changes["rpm_limit"] = args.rpm_limit
    if args.kv_budget_ratio is not None:
        changes["tenant_kv_budget_ratio"] = args.kv_budget_ratio
    if not control:
        changes.update(max_queued_per_tenant=10 ** 9, max_queued_total=10 ** 9)
    label = args.policy
    if baseline:
        defaults = SchedulerConfig()
        if control:  # kvmeter's bounded queues come with its overload control
            changes.update(max_queued_per_tenant=defaults.max_queued_per_tenant,
                           max_queued_total=defaults.max_queued_total)
        label += "+overload-control" if control else ""
        label += "+kv-budget" if args.kv_budget_ratio is not None else ""
        return SchedulerConfig.plain_baseline(**changes), label
    return dataclasses.replace(SchedulerConfig(), **changes), label


def run(args: argparse.Namespace) -> int:
    """Run the simulation and write the report; 0 on success, 2 on bad input."""
    try:
        requests = _workload(args)
        scfg, label = scheduler_config(args)
        sim = SimConfig(model=args.model, gpu=args.gpu, tp=args.tp, replicas=args.replicas,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        long_prefill_token_threshold=args.long_prefill_threshold,
                        enable_prefix_caching=not args.no_prefix_caching,
                        compute_efficiency=args.compute_efficiency, memory_efficiency=args.memory_efficiency,
                        step_overhead_s=args.step_overhead_s, max_model_len=args.max_model_len,
                        routing=args.routing)
        simulation = Simulation(requests, policy=args.policy, scheduler_config=scfg, sim=sim,
                                progress=not args.no_progress)
    except (ValueError, TraceError, FileNotFoundError, OSError) as err:
        print(f"kvmeter simulate: {err}", file=sys.stderr)
        return 2
    result = simulation.run()
    report = build_report(result, trace=str(args.trace), policy_label=label)
    print(format_report(report, top_tenants=args.top_tenants))
    trace_label = str(args.trace).replace("/", "_").replace(".", "_")
    prefix = args.out or str(DEFAULT_OUT_DIR / f"kvmeter-sim-{trace_label}-{label}")
    try:
        paths = write_report(report, prefix)
    except OSError as err:
        print(f"kvmeter simulate: cannot write the report: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
