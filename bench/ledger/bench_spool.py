"""Spool appends per second with group-committed fsync.

Measures, in one run, on the same disk:

* ``ledger.record()`` awaited by C concurrent asyncio tasks (the gateway's path: each task awaits
  its own event), C = 250, 1000 and 4000, on the default event loop and on uvloop (what uvicorn
  runs) — the throughput is the best of these rows, as for any saturation figure;
* ``ledger.record_sync()`` from T threads;
* ``SpoolStream.submit()`` of pre-encoded lines from T threads (the spool alone, no encoding);
* the same submit path with fsync off — what group commit saves against its cost.

Every appended record is durable (fsynced) when counted, except in the fsync-off row.

    .venv/bin/python bench/ledger/bench_spool.py [--events 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

from kvmeter.attribution import Attribution
from kvmeter.clock import SYSTEM_CLOCK
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import Ledger, LedgerConfig
from kvmeter.ledger.records import STREAMS, encode_usage
from kvmeter.ledger.spool import Spool
from kvmeter.tokens import TokenCounts

T0 = 1_794_700_800.0


def events(n: int, offset: int = 0) -> list[UsageEvent]:
    return [UsageEvent(event_id=event_id_for(f"t{i % 100}", f"k{i}"), request_id=f"r{i}",
                       attribution=Attribution(f"t{i % 100}", workspace_id="ws", project_id="p",
                                               api_key_id=f"k{i % 7}", tier="paid_interactive",
                                               model="SmolLM2-135M-Instruct", endpoint="chat.completions"),
                       tokens=TokenCounts(input_tokens=25 + i % 500, output_tokens=100), outcome="ok",
                       finish_reason="stop", arrival_ts=T0 + i * 0.001, finish_ts=T0 + i * 0.001 + 1, ttft_s=0.1,
                       itl_mean_s=0.02, e2e_s=2.0, kv_token_seconds=250.0)
            for i in range(offset, offset + n)]


def bench_async(root: Path, evs: list[UsageEvent], concurrency: int, use_uvloop: bool) -> tuple[float, int]:
    cfg = LedgerConfig(dsn=f"chdb://{root / 'chdb'}", spool_dir=root / "spool", flush_interval_s=3600)
    ledger = Ledger.open(cfg)
    per = len(evs) // concurrency

    async def worker(chunk: list[UsageEvent]) -> None:
        for e in chunk:
            await ledger.record(e)

    async def main() -> float:
        t = time.perf_counter()
        await asyncio.gather(*(worker(evs[i * per:(i + 1) * per]) for i in range(concurrency)))
        return time.perf_counter() - t

    if use_uvloop:
        import uvloop
        dt = uvloop.run(main())
    else:
        dt = asyncio.run(main())
    fsyncs = ledger.stats().fsyncs_total
    ledger.close()
    return per * concurrency / dt, fsyncs


def bench_threads(root: Path, evs: list[UsageEvent], threads: int) -> tuple[float, int]:
    cfg = LedgerConfig(dsn=f"chdb://{root / 'chdb'}", spool_dir=root / "spool", flush_interval_s=3600)
    ledger = Ledger.open(cfg)
    per = len(evs) // threads

    def work(chunk: list[UsageEvent]) -> None:
        for e in chunk:
            ledger.record_sync(e)

    ts = [threading.Thread(target=work, args=(evs[i * per:(i + 1) * per],)) for i in range(threads)]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    dt = time.perf_counter() - t
    fsyncs = ledger.stats().fsyncs_total
    ledger.close()
    return per * threads / dt, fsyncs


def bench_raw(root: Path, lines: list[bytes], threads: int, fsync: bool) -> tuple[float, int]:
    spool = Spool(root / "raw-spool", STREAMS, clock=SYSTEM_CLOCK, fsync=fsync)
    stream = spool.streams["usage"]
    per = len(lines) // threads
    window = 256  # each thread keeps this many appends in flight, then waits for durability

    def work(chunk: list[bytes]) -> None:
        for i in range(0, len(chunk), window):
            ticket = None
            for line in chunk[i:i + window]:
                ticket = stream.submit(line)
            ticket.wait(60)

    ts = [threading.Thread(target=work, args=(lines[i * per:(i + 1) * per],)) for i in range(threads)]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    dt = time.perf_counter() - t
    fsyncs = stream.fsyncs_total
    spool.close()
    return per * threads / dt, fsyncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir on the project's disk)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; best and median are reported")
    args = ap.parse_args()
    n = args.events
    print(f"# spool append benchmark — {platform.node()} {platform.machine()}, python {platform.python_version()}")
    print(f"# {n:,} events per row; every counted append is fsynced (group commit) unless noted")
    evs = events(n)
    lines = [encode_usage(e) for e in evs]
    rows = []
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvmeter-bench-spool-"))
    try:
        cases = [
            ("record() asyncio, 250 tasks", lambda d: bench_async(d, evs, 250, False)),
            ("record() asyncio, 1000 tasks", lambda d: bench_async(d, evs, 1000, False)),
            ("record() asyncio, 4000 tasks", lambda d: bench_async(d, evs, 4000, False)),
            ("record() uvloop, 250 tasks", lambda d: bench_async(d, evs, 250, True)),
            ("record() uvloop, 1000 tasks", lambda d: bench_async(d, evs, 1000, True)),
            ("record() uvloop, 4000 tasks", lambda d: bench_async(d, evs, 4000, True)),
            ("record_sync(), 16 threads", lambda d: bench_threads(d, evs, 16)),
            ("spool submit (pre-encoded), 8 threads", lambda d: bench_raw(d, lines, 8, True)),
            ("spool submit (pre-encoded), 8 threads, fsync OFF", lambda d: bench_raw(d, lines, 8, False)),
        ]
        print(f"{'case':52s} {'best':>12s} {'median':>12s}  appends/s   records per fsync (best run)")
        for i, (name, fn) in enumerate(cases):
            runs = []
            for r in range(args.repeat):
                d = base / f"case{i}-{r}"
                runs.append(fn(d))
                shutil.rmtree(d, ignore_errors=True)
            runs.sort(key=lambda x: x[0])
            best, median = runs[-1], runs[len(runs) // 2]
            rows.append((name, best[0], median[0]))
            print(f"{name:52s} {best[0]:>12,.0f} {median[0]:>12,.0f}  {n / max(best[1], 1):>10,.0f}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
