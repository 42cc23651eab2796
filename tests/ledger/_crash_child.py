"""Child process for the crash test (run as a script, not collected by pytest).

    _crash_child.py append CHDB SPOOL START   record events START, START+1, ... forever, printing
                                              the number acknowledged (durable) after each group
    _crash_child.py drain  CHDB SPOOL         open, flush, print counts as JSON
"""

from __future__ import annotations

import asyncio
import json
import sys

from ledgerkit import make_event

from kvmeter.ledger import Ledger, LedgerConfig


def main() -> None:
    mode, chdb, spool = sys.argv[1:4]
    # a short flush interval keeps the writer inserting while records arrive, so the kill can
    # land in the middle of a group commit, a drain batch or a drain-position update
    config = LedgerConfig(dsn=f"chdb://{chdb}", spool_dir=spool, flush_interval_s=0.02, batch_size=300)
    ledger = Ledger.open(config)
    if mode == "append":
        start = int(sys.argv[4])

        async def run() -> None:
            i = start
            while True:
                await asyncio.gather(*(ledger.record(make_event(n)) for n in range(i, i + 50)))
                i += 50
                print(i, flush=True)  # every event below i is durable

        asyncio.run(run())
    else:
        ok = ledger.flush(60)
        client = ledger.query_client()
        q = lambda sql: client.query(sql).result_rows  # noqa: E731
        print(json.dumps({
            "flushed": ok,
            "raw": q("SELECT count() FROM usage_events")[0][0],
            "final": q("SELECT count() FROM usage_events FINAL")[0][0],
            "distinct": q("SELECT uniqExact(event_id) FROM usage_events")[0][0],
            "request_ids": [r[0] for r in q("SELECT request_id FROM usage_events FINAL")],
            "input_tokens": q("SELECT sum(input_tokens) FROM usage_events FINAL")[0][0],
        }))
        ledger.close()


if __name__ == "__main__":
    main()
