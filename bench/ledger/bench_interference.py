"""The interference read (``kvmeter.ledger.interference``) and the per-step writer on chDB.

Writes ``--steps`` engine steps of 5 tenants (0.02 s each, one engine) through
``Ledger.record_step_shares`` (timed: the cost on the engine's output loop), drains them, adds
``--victims`` acme requests that missed their 2 s TTFT objective (3 s windows, each named in one
step's prefill ids), then times the read (best of 3). Results: ``bench/ledger/RESULTS.md``,
"Interference".

    .venv/bin/python bench/ledger/bench_interference.py --steps 20000 --victims 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "ledger"))

from ledgerkit import MODEL, T0, make_event  # noqa: E402

from kvmeter.ledger import Ledger, LedgerConfig  # noqa: E402
from kvmeter.ledger.period import parse_period  # noqa: E402
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS  # noqa: E402
from kvmeter.stats import EngineStepShares, TenantStepShare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--victims", type=int, default=200)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-interference-"))
    ledger = Ledger.open(LedgerConfig(dsn=f"chdb://{root}/chdb", spool_dir=root / "spool",
                                      flush_interval_s=3600, rollup_interval_s=3600,
                                      engine_steps_retention_days=0))  # T0 is in the past: keep the steps
    victims = [f"acme-v{j}" for j in range(args.victims)]
    per_victim = max(1, args.steps // args.victims)
    steps = []
    for i in range(args.steps):
        j = i // per_victim  # the victim whose prefill is this step's (mid-window)
        ids = (victims[j],) if i % per_victim == per_victim // 2 and j < len(victims) else ()
        steps.append(EngineStepShares(wall_ts=T0 + i * 0.02, duration_s=0.02, tenants=(
            TenantStepShare("acme", "paid_interactive", 64 if ids else 0, 8, 5000, 8, ids),
            *(TenantStepShare(f"t{k}", "paid_interactive", 64 * (k == 1), 8, 5000, 8) for k in range(1, 5)))))
    t = time.perf_counter()
    for s in steps:
        ledger.record_step_shares(s, model=MODEL, replica="r1")
    write_us = (time.perf_counter() - t) / len(steps) * 1e6

    async def record() -> None:
        for j, v in enumerate(victims):
            start = T0 + j * per_victim * 0.02
            await ledger.record(make_event(0, request_id=v, arrival_ts=start, finish_ts=start + 3.5, ttft_s=3.0))

    asyncio.run(record())
    t = time.perf_counter()
    assert ledger.flush(300)
    drain_s = time.perf_counter() - t
    slos = [(p.name, p.ttft_slo_s, p.itl_slo_s) for p in DEFAULT_TIERS.values()]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        rows = ledger.interference.interference(parse_period("2026-11"), slos=slos)
        best = min(best, time.perf_counter() - t)
    ledger.close()
    print(f"record_step_shares: {write_us:.1f} µs per step (5 tenants); drain of {len(steps) * 5:,} rows: "
          f"{drain_s:.2f} s; interference read, {args.victims} missed requests: {best * 1000:.0f} ms "
          f"(best of 3), {len(rows)} rows; top neighbour {rows[0]['neighbour']} prefill share "
          f"{rows[0]['prefill_share']:.3f}")


if __name__ == "__main__":
    main()
