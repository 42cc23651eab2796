"""Benchmark: the ClickHouse signal sampler's cost per tick.

    .venv/bin/python bench/exporters/bench_signals.py [--tenants 1000] [--runs 30]

One tick of ``kvmeter serve``'s signal recorder = ``SignalSampler.sample()`` (build the rows on the
event loop) + ``Ledger.write_signals(rows)`` (hand them to the writer's buffer) + the writer
thread's insert into ClickHouse. Measured against the real embedded ledger (chDB in a temporary
directory), with the state a busy server holds between two ticks:

  * a ``SchedulerStats`` listing ``--tenants`` tenants over 4 tiers, every one with queued or
    running work (the worst case: idle tenants cost no rows);
  * 8 engines' steps, 4 tiers' request completions (the interval's rates), 8 GPUs from the real
    H200 capture plus the real H100 MIG capture, ``LedgerStats`` and a quota store state.

The insert is timed with ``Ledger.flush()``, which forces one writer round and waits for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvmeter.attribution import Attribution
from kvmeter.tokens import TokenCounts
from kvmeter.traces import data_dir

REPO = Path(__file__).resolve().parents[2]

DATA = data_dir()
sys.path.insert(0, str(Path(__file__).parent))

from bench_render import TIERS, scheduler_snapshot  # noqa: E402


def fmt(times: list[float]) -> str:
    q = statistics.quantiles(times, n=20)[-1] if len(times) >= 2 else times[0]
    return f"median {statistics.median(times) * 1e3:.1f} ms, p95 {q * 1e3:.1f} ms"


def feed(bus, clock, rng, tenants: int) -> None:
    """What a busy server publishes during one interval."""
    from kvmeter.stats import QuotaStoreState
    from kvmeter.stats import EngineStepStats, RequestCompletion

    snap = scheduler_snapshot(rng, tenants, 1)
    for t in snap.tenants:  # every tenant busy: the most rows a tick can write
        t.running = max(t.running, 1)
        t.active_kv_tokens = max(t.active_kv_tokens, 100)
    bus.publish(snap)
    for engine in range(8):
        for _ in range(20):
            bus.publish(EngineStepStats(wall_ts=clock.wall(), engine_idx=engine, kv_watermark_ratio=rng.random(),
                                        kv_blocks_total=80_000, num_running=64, num_waiting=3,
                                        output_tokens=64, num_preempted=rng.randint(0, 1)))
    for i in range(400):
        bus.publish(
            RequestCompletion(
                attribution=Attribution(f"tenant-{i:04d}", tier=TIERS[i % 4], model="m"),
                tokens=TokenCounts(input_tokens=rng.randint(50, 4000), output_tokens=rng.randint(1, 500)),
                outcome="ok",
                slo_met=rng.random() < 0.9,
            )
        )
    bus.publish(QuotaStoreState(store="redis", degraded=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    from kvmeter.bus import StatsBus
    from kvmeter.clock import ManualClock
    from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
    from kvmeter.exporters.signals import SignalSampler, SignalSamplerConfig
    from kvmeter.ledger import Ledger, LedgerConfig

    rng = random.Random(1)
    clock = ManualClock()
    bus = StatsBus()
    sampler = SignalSampler(bus, clock=clock, model="llama-70b", config=SignalSamplerConfig())
    gpu_dir = DATA / "gpu" / "nvidia_smi"
    h200 = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h200__590.48.01.txt"),
                         clock=clock).collect()[0]
    mig = NvmlCollector(CaptureNvml.from_file(gpu_dir / "linux-x86_64__nvidia-h100-mig__590.48.01.txt"),
                        clock=clock).collect()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger.open(LedgerConfig(dsn=f"chdb://{tmp}/chdb", spool_dir=Path(tmp) / "spool",
                                          flush_interval_s=3600, rollup_interval_s=3600), clock=clock)
        try:
            sample_t, write_t, insert_t, rows_n = [], [], [], []
            for run in range(args.runs + 1):
                feed(bus, clock, rng, args.tenants)
                for index in range(8):
                    bus.publish(dataclasses.replace(h200, index=index))
                bus.publish(dataclasses.replace(mig, index=8))
                bus.publish(ledger.stats())
                clock.advance(10)
                t0 = time.perf_counter()
                rows = sampler.sample()
                t1 = time.perf_counter()
                ledger.write_signals(rows)
                t2 = time.perf_counter()
                assert ledger.flush(60.0), "the ledger did not drain"
                t3 = time.perf_counter()
                if run:  # the first round warms up (client, parts)
                    sample_t.append(t1 - t0)
                    write_t.append(t2 - t1)
                    insert_t.append(t3 - t2)
                    rows_n.append(len(rows))
            stored = ledger.query_client().query("SELECT count() FROM signals").result_rows[0][0]
            assert stored == sum(rows_n) + rows_n[0], (stored, rows_n)  # warm-up round included
        finally:
            ledger.close()
    print(f"tenants {args.tenants}, rows per tick {statistics.median(rows_n):.0f}, runs {args.runs}")
    print("| step | where | cost per tick |")
    print("|---|---|---|")
    print(f"| `SignalSampler.sample()` (build {statistics.median(rows_n):.0f} rows) "
          f"| worker thread (asyncio.to_thread) | {fmt(sample_t)} |")
    print(f"| `Ledger.write_signals(rows)` | event loop | {fmt(write_t)} |")
    print(f"| insert into chDB (`flush()`: one writer round) | ledger writer thread | {fmt(insert_t)} |")


if __name__ == "__main__":
    main()
