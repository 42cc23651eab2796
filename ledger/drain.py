"""The background writer: drains the spool into ClickHouse in batches, exactly once (billing sense).

One thread. Each round, for each stream, it takes the next batch of durable blocks, marks it
in flight (range + dedup token, fsynced), inserts it with ``insert_deduplication_token`` and
records the new drain position. An insert that fails because ClickHouse is away is retried
with exponential back-off (on the injected clock); one that fails because of its *data* is
bisected until the offending record(s) are isolated and moved to ``rejected.ndjson`` — a bad
record can delay, never block, the drain.

It also inserts buffered signal samples and refreshes the hourly rollups every
``rollup_interval_s``. Blocking waits use real time (a thread has to sleep on something);
every decision about *when* to retry reads the injected clock, and :meth:`Writer.flush` forces
a round at once, so tests never sleep.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any, Callable

from clickhouse_connect.driver.client import Client

from kvmeter.clock import Clock

from .config import LedgerConfig
from .connection import ClientHolder, describe_error, is_data_error
from .errors import LedgerError
from .records import SignalSample, StreamSpec
from .spool import BatchPayload, DrainBatch, Spool, SpoolStream

__all__ = ["Writer"]

log = logging.getLogger(__name__)


#: ``min_chunk_bytes_for_parallel_parsing`` of the drain's inserts.
PARSE_CHUNK_BYTES = 1 << 20


class Writer:
    """Drains a :class:`~kvmeter.ledger.spool.Spool` into ClickHouse on its own thread.

    Args:
        spool: the open spool.
        holder: the writer's own ClickHouse client holder.
        config: batch size, intervals, back-off, cluster mode.
        clock: decides back-off and rollup timing (monotonic).
        on_round: called (on the writer thread) after every round, e.g. to publish stats.
        refresh_rollups: ``f(client)`` run every ``rollup_interval_s`` after a good round.
    """

    def __init__(self, spool: Spool, holder: ClientHolder, config: LedgerConfig, clock: Clock, *,
                 on_round: Callable[[], None] | None = None,
                 refresh_rollups: Callable[[Client], Any] | None = None) -> None:
        self._spool = spool
        self._holder = holder
        self._config = config
        self._clock = clock
        self._on_round = on_round
        self._refresh_rollups = refresh_rollups
        self._cond = threading.Condition()
        self._requested = 0  # forced-round requests
        self._completed = 0  # forced requests served (the value of _requested a round started with)
        self._last_ok = False
        self._stopping = False
        self._backoff = 0.0
        self._next_try = float("-inf")
        self._next_rollup = float("-inf")
        self.signals: deque[SignalSample] = deque(maxlen=config.signal_buffer)
        self.signals_dropped_total = 0
        self.drained_total: dict[str, int] = {name: 0 for name in spool.streams}
        self.insert_batches_total = 0
        self.insert_retries_total = 0
        self.rejected_total = 0
        self.clickhouse_up = False
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="kvmeter-ledger-writer", daemon=True)

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def add_signals(self, samples: list[SignalSample]) -> None:
        """Buffer signal samples for the next round (oldest dropped when full, counted)."""
        overflow = len(self.signals) + len(samples) - (self.signals.maxlen or 0)
        if overflow > 0:
            self.signals_dropped_total += overflow
        self.signals.extend(samples)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Drain everything durable or pending at call time; True when it is all in ClickHouse.

        Forces one round now (ignoring back-off). Returns False at once if that round fails
        (ClickHouse away) or when ``timeout_s`` passes first.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for stream in self._spool.streams.values():
                stream.sync(max(0.0, deadline - time.monotonic()))
        except (TimeoutError, LedgerError):
            return False
        targets = {name: s.durable_end() for name, s in self._spool.streams.items()}
        with self._cond:
            self._requested += 1
            mine = self._requested
            self._cond.notify_all()
            while self._completed < mine:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            ok = self._last_ok
        return ok and all(self._spool.streams[n].drained_position() >= t for n, t in targets.items())

    def stop(self, timeout_s: float) -> bool:
        """Run a last round and stop the thread; True if it stopped within ``timeout_s``."""
        with self._cond:
            self._stopping = True
            self._requested += 1
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._requested == self._completed and not self._stopping:
                    self._cond.wait(self._config.flush_interval_s)
                forced_upto = self._requested
                stopping = self._stopping
            forced = forced_upto > self._completed
            ok = self._last_ok
            if forced or self._clock.monotonic() >= self._next_try:
                try:
                    ok = self._round()
                except Exception as exc:  # noqa: BLE001 — the writer thread must survive anything
                    log.exception("ledger writer round failed unexpectedly")
                    ok = self._failed(exc)
            with self._cond:
                self._last_ok = ok
                self._completed = max(self._completed, forced_upto)
                self._cond.notify_all()
            if self._on_round is not None:
                try:
                    self._on_round()
                except Exception:  # noqa: BLE001
                    log.exception("ledger stats callback failed")
            if stopping:
                return

    def _failed(self, exc: BaseException) -> bool:
        self.clickhouse_up = False
        self.last_error = describe_error(exc)
        self.insert_retries_total += 1
        self._backoff = min(self._config.retry_max_s, max(self._config.retry_initial_s, self._backoff * 2))
        self._next_try = self._clock.monotonic() + self._backoff
        self._holder.reset()
        log.warning("ledger writer: ClickHouse unavailable (%s); retrying in %.1f s", self.last_error, self._backoff)
        return False

    def _round(self) -> bool:
        try:
            client = self._holder.get()
        except LedgerError as exc:
            return self._failed(exc)
        # A round drains each stream up to where it was durable when the round began. Records
        # made durable during the round's inserts wait for the next round (flush_interval_s
        # later, or a forced one): draining every stream until it is empty never ended a round
        # under steady traffic, so the first stream was inserted a few records at a time (each
        # insert costs ClickHouse milliseconds of CPU, whatever its size) and the streams after
        # it waited until the traffic stopped (bench/quota/RESULTS.md, "Where the CPU goes on
        # vLLM's layer").
        targets = {name: stream.durable_end() for name, stream in self._spool.streams.items()}
        for name, stream in self._spool.streams.items():
            while stream.drained_position() < targets[name]:
                batch = stream.next_batch(self._config.batch_size)
                if batch is None:
                    break
                try:
                    payload = stream.read_batch_views(batch)
                except (OSError, ValueError) as exc:
                    path = stream.quarantine(batch)
                    log.error("ledger writer: %s; %d records copied to %s and skipped", exc, batch.count, path)
                    self.rejected_total += batch.count
                    stream.complete(batch)
                    continue
                stream.begin(batch)
                try:
                    self._insert_batch(client, stream, batch, payload)
                except Exception as exc:  # noqa: BLE001 — outage: keep the batch in flight, retry later
                    return self._failed(exc)
                stream.complete(batch)
                self.drained_total[stream.name] += batch.count
        self._insert_signals(client)
        self.clickhouse_up = True
        self.last_error = ""
        self._backoff = 0.0
        self._next_try = float("-inf")
        if self._refresh_rollups is not None and self._clock.monotonic() >= self._next_rollup:
            self._next_rollup = self._clock.monotonic() + self._config.rollup_interval_s
            try:
                self._refresh_rollups(client)
            except Exception as exc:  # noqa: BLE001 — rollups are derived; retry next interval
                log.warning("ledger writer: rollup refresh failed: %s", describe_error(exc))
        return True

    # ------------------------------------------------------------------ inserts

    def _settings(self, token: str) -> dict[str, Any]:
        # optimize_on_insert 0: dedup is left to FINAL/merges (doubled the drain rate);
        # 1 MiB parsing chunks instead of the default 10 MiB: a 200k-event batch (~60 MB of JSON)
        # is parsed by all threads in step (bench/ledger/RESULTS.md: 256-316k → 336k events/s)
        settings: dict[str, Any] = {"insert_deduplication_token": token, "optimize_on_insert": 0,
                                    "min_chunk_bytes_for_parallel_parsing": PARSE_CHUNK_BYTES}
        if self._config.cluster:
            settings["distributed_foreground_insert"] = 1
        return settings

    def _raw_insert(self, client: Client, spec: StreamSpec, columns: tuple[str, ...],
                    payload: bytes | BatchPayload, token: str) -> None:
        if isinstance(payload, BatchPayload):
            # chDB copies a readable block into its input file view by view; a server gets one
            # buffer, which its HTTP client can resend on a retry
            payload = payload if self._config.embedded else payload.tobytes()
        # (clickhouse-connect types insert_block as a BinaryIO; chDB's client only read()s it)
        client.raw_insert(spec.table, column_names=list(columns), insert_block=payload,  # type: ignore[arg-type]
                          fmt="JSONCompactEachRow", settings=self._settings(token))
        self.insert_batches_total += 1

    def _insert_batch(self, client: Client, stream: SpoolStream, batch: DrainBatch, payload: BatchPayload) -> None:
        # a block an older kvmeter wrote is mapped to today's columns here (StreamSpec.decode);
        # the current schema passes through untouched
        columns, rows = stream.spec.decode(batch.schema, payload)
        try:
            self._raw_insert(client, stream.spec, columns, rows, batch.token)
            return
        except Exception as exc:  # noqa: BLE001
            if not is_data_error(exc):
                raise
            log.error("ledger writer: ClickHouse refused %s batch %s as data (%s); isolating the bad records",
                      stream.name, batch.token, describe_error(exc))
        data = rows if isinstance(rows, bytes) else rows.tobytes()
        lines = data.rstrip(b"\n").split(b"\n")
        rejected = self._bisect(client, stream.spec, columns, lines, batch.token)
        if rejected:
            self._dead_letter(stream, batch, rejected)

    def _bisect(self, client: Client, spec: StreamSpec, columns: tuple[str, ...], lines: list[bytes],
                token: str) -> list[tuple[bytes, str]]:
        try:
            self._raw_insert(client, spec, columns, b"\n".join(lines) + b"\n", token)
            return []
        except Exception as exc:  # noqa: BLE001
            if not is_data_error(exc):
                raise
            if len(lines) == 1:
                return [(lines[0], describe_error(exc))]
        mid = len(lines) // 2
        return (self._bisect(client, spec, columns, lines[:mid], token + ":L")
                + self._bisect(client, spec, columns, lines[mid:], token + ":R"))

    def _dead_letter(self, stream: SpoolStream, batch: DrainBatch, rejected: list[tuple[bytes, str]]) -> None:
        path = stream.dir / "rejected.ndjson"
        now = self._clock.wall()
        with open(path, "ab") as fh:
            for line, error in rejected:
                fh.write(json.dumps({"stream": stream.name, "table": stream.spec.table, "token": batch.token,
                                     "rejected_at": now, "error": error,
                                     "record": line.decode("utf-8", "replace")}).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.rejected_total += len(rejected)
        log.error("ledger writer: %d %s record(s) refused by ClickHouse moved to %s", len(rejected), stream.name, path)

    def _insert_signals(self, client: Client) -> None:
        if not self.signals:
            return
        taken: list[SignalSample] = []
        while self.signals and len(taken) < 100_000:
            taken.append(self.signals.popleft())
        rows = [[datetime.fromtimestamp(s.ts, tz=timezone.utc), s.name, dict(s.labels), float(s.value)] for s in taken]
        try:
            client.insert("signals", rows, column_names=["ts", "name", "labels", "value"])
        except Exception as exc:  # noqa: BLE001 — signals are best effort; keep them for the next round
            self.signals.extendleft(reversed(taken))
            log.warning("ledger writer: signal insert failed (%s); %d samples kept", describe_error(exc), len(taken))
