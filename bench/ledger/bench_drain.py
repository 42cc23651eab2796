"""Spool → ClickHouse drain rate into chDB, beside a bare Arrow insert of the same rows (the ceiling).

A spool is filled with N usage events (group-committed, fsynced), then a fresh Ledger drains it
with ``flush()`` — the rate counts reading + CRC-checking the spool, the in-flight/position
fsyncs and ClickHouse parsing, sorting and writing the parts. In the same run the same N rows
are inserted as one Arrow table (``client.insert_arrow``) into (a) a plain ``MergeTree ORDER BY
tuple()`` copy of the table and (b) a ReplacingMergeTree copy with the ledger's sort key.

    .venv/bin/python bench/ledger/bench_drain.py [--events 1000000] [--batch-size 200000]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_spool import events  # noqa: E402

from kvmeter.clock import SYSTEM_CLOCK  # noqa: E402
from kvmeter.ledger import Ledger, LedgerConfig  # noqa: E402
from kvmeter.ledger.records import STREAMS, encode_usage  # noqa: E402
from kvmeter.ledger.spool import Spool  # noqa: E402


def _wait_for_merges(client, limit_s: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + limit_s
    while client.query("SELECT count() FROM system.merges").result_rows[0][0] and time.monotonic() < deadline:
        time.sleep(0.5)  # measure each insert at rest, not beside the previous one's merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=200_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    n = args.events
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvmeter-bench-drain-"))
    print(f"# drain benchmark — {platform.node()} {platform.machine()}, python {platform.python_version()}, "
          f"{n:,} events, batch {args.batch_size:,}")
    try:
        t = time.perf_counter()
        spool = Spool(base / "spool", STREAMS, clock=SYSTEM_CLOCK)
        stream = spool.streams["usage"]
        step = 100_000
        for i in range(0, n, step):
            stream.submit_many([encode_usage(e) for e in events(min(step, n - i), i)]).wait(120)
            print(f"  spooled {min(i + step, n):,}", file=sys.stderr, flush=True)
        size = stream.depth()[1]
        spool.close()
        print(f"spool filled: {n:,} events, {size / 1e6:,.0f} MB in {time.perf_counter() - t:.1f} s")

        drain_rates: list[float] = []
        arrow_rates: dict[str, list[float]] = {}
        # Since migration 0006 usage_events has primary key (tenant_id, event_id) and sorting key
        # (tenant_id, event_id, attempt_id); `CREATE TABLE ... AS usage_events` copies the primary
        # key, so each ceiling table states its own.
        engines = {"MergeTree ORDER BY tuple()": "MergeTree PRIMARY KEY tuple() ORDER BY tuple()",
                   "ReplacingMergeTree, the ledger's sort key":
                       "ReplacingMergeTree(attempt) PRIMARY KEY (tenant_id, event_id) "
                       "ORDER BY (tenant_id, event_id, attempt_id)"}
        for r in range(args.repeat):
            shutil.copytree(base / "spool", base / f"spool-{r}")
            cfg = LedgerConfig(dsn=f"chdb://{base / f'chdb-{r}'}", spool_dir=base / f"spool-{r}",
                               flush_interval_s=3600, batch_size=args.batch_size)
            ledger = Ledger.open(cfg)
            client = ledger.query_client()
            t = time.perf_counter()
            assert ledger.flush(timeout_s=3600), ledger.stats().last_error
            dt = time.perf_counter() - t
            stored = client.query("SELECT count() FROM usage_events").result_rows[0][0]
            assert stored == n, (stored, n)
            drain_rates.append(n / dt)
            print(f"  run {r + 1}: drain {n / dt:,.0f} events/s ({dt:.2f} s)", flush=True)
            table = client.query_arrow("SELECT * EXCEPT (ingested_at, request_key, event_key) FROM usage_events")
            for name, engine in engines.items():
                _wait_for_merges(client)
                client.command("DROP TABLE IF EXISTS arrow_ceiling")
                client.command(f"CREATE TABLE arrow_ceiling AS usage_events ENGINE = {engine}")
                t = time.perf_counter()
                client.insert_arrow("arrow_ceiling", table)
                dt = time.perf_counter() - t
                arrow_rates.setdefault(name, []).append(n / dt)
                print(f"  run {r + 1}: bare Arrow insert into {name}: {n / dt:,.0f} rows/s ({dt:.2f} s)", flush=True)
            client.command("DROP TABLE IF EXISTS arrow_ceiling")
            ledger.close()
            shutil.rmtree(base / f"chdb-{r}", ignore_errors=True)
        best_drain = max(drain_rates)
        print(f"drain spool -> chDB (JSONCompactEachRow, dedup token), best of {args.repeat}: "
              f"{best_drain:>12,.0f} events/s")
        for name, rates in arrow_rates.items():
            print(f"bare Arrow insert into {name}, best of {args.repeat}: {max(rates):>12,.0f} rows/s "
                  f"(drain / this = {best_drain / max(rates):.2f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
