"""The durable spool (write-ahead log) between the serving path and ClickHouse.

Layout of a spool directory (one process holds it, through ``flock`` on ``LOCK``)::

    LOCK                      held by the owning process
    spool.json                {"spool_id": "<uuid4>", "format": 1} — scopes dedup tokens
    usage/000000000001.wal    segments of one stream, rotated at ``segment_bytes``
    usage/drain.json          durable drain position + the batch in flight
    usage/rejected.ndjson     records ClickHouse refused as data (dead letters)
    attempts/...  engine/...

A segment is a sequence of blocks; one block is one group commit (or a slice of one)::

    header  28 bytes  <4s H H I I I d>: magic b"KVS1", schema, flags(0), payload_len,
                       record_count, crc32(header fields + payload), first_wall_ts
    payload           record_count lines, each a JSON array + b"\\n" (ClickHouse
                       JSONCompactEachRow, columns per the stream's schema version)

Group commit (the technique of database WALs, e.g. PostgreSQL's ``commit_delay`` group flush):
``submit`` appends a line to the pending group in memory and returns that group's
:class:`CommitTicket`; one committer thread per stream writes the whole group with one
``write`` and one ``fdatasync``, then resolves the ticket for every waiter at once. While an
fsync runs, new records gather in the next group, so throughput grows with concurrency.

Recovery (on open): blocks are re-validated from the durable drain position; a torn tail
(a crash mid-write: short block or CRC mismatch) is truncated away — those records were never
acknowledged, since a ticket resolves only after fsync. Damage before the tail is copied to a
``.corrupt`` file and cut, loudly.

Exactly-once drain: before inserting a batch the drain writes the batch's byte range and
dedup token to ``drain.json`` ("in flight"); after the insert it writes the new position. A
crash in between re-sends the *same* range with the *same* token, which ClickHouse drops
(``insert_deduplication_token``); and the tables' ReplacingMergeTree key deduplicates anyway.

Why this module is longer than ~600 lines: the block format, group commit, recovery and the
drain position are one write-ahead log. They share the segment layout, the lock and the
durable-position invariant (nothing is acknowledged before it is fsynced, nothing is drained
twice); split apart, each piece would have to expose the others' internals.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import threading
import uuid
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kvmeter.clock import Clock

from .errors import LedgerLocked, SpoolWriteError
from .records import StreamSpec

__all__ = ["Spool", "SpoolStream", "CommitTicket", "Block", "DrainBatch", "BatchPayload", "HEADER", "MAGIC",
           "lock_held_elsewhere"]

log = logging.getLogger(__name__)

MAGIC = b"KVS1"
#: ``flock(LOCK_NB)`` errors meaning another open file description holds the lock.
_LOCK_HELD_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
HEADER = struct.Struct("<4sHHIIId")
_META = struct.Struct("<HHIId")  # the header fields the CRC covers (all but magic and crc)
MAX_BLOCK_PAYLOAD = 8 * 1024 * 1024
_SEGMENT_SUFFIX = ".wal"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: dict, *, fsync: bool) -> None:
    tmp = path.with_suffix(".tmp")
    raw = json.dumps(data, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, raw)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


class CommitTicket:
    """The shared fate of one commit group: resolved once its records are fsynced (or failed).

    Any number of threads (:meth:`wait`) and coroutines on any event loops (:meth:`wait_async`)
    may wait on one ticket; the committer resolves it once.
    """

    __slots__ = ("_done", "_error", "_lock", "_event", "_futures", "_loop0", "_fut0")

    def __init__(self) -> None:
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._futures: dict[asyncio.AbstractEventLoop, asyncio.Future[None]] = {}
        self._loop0: asyncio.AbstractEventLoop | None = None  # lock-free fast path: the first loop
        self._fut0: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        """True once the group was fsynced or failed."""
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        """Block until durable.

        Raises:
            TimeoutError: if not resolved within ``timeout`` seconds.
            SpoolWriteError: if the group could not be written.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"spool commit not durable within {timeout} s")
        if self._error is not None:
            raise self._error

    async def wait_async(self) -> None:
        """Await durability without blocking the event loop.

        All coroutines of one loop share one future. Cancelling an awaiting task takes effect
        when the group resolves (within one fsync); it does not un-write the record.
        Raises:
            SpoolWriteError: if the group could not be written.
        """
        if not self._done:
            fut = self.shared_future()
            if fut is not None:
                await fut
        if self._error is not None:
            raise self._error

    def shared_future(self) -> "asyncio.Future[None] | None":
        """The running loop's shared future for this group (``None`` if already resolved).

        Await it, then check :meth:`raise_if_failed` — the inlined form of :meth:`wait_async`.
        """
        loop = asyncio.get_running_loop()
        if self._loop0 is loop:  # set once under the lock, never changed
            return self._fut0
        with self._lock:
            if self._done:
                return None
            fut = self._futures.get(loop)
            if fut is None:
                fut = self._futures[loop] = _SharedFuture(loop=loop)
                if self._loop0 is None:
                    self._fut0 = fut
                    self._loop0 = loop
            return fut

    def raise_if_failed(self) -> None:
        """Raise the group's write error, if it failed."""
        if self._error is not None:
            raise self._error

    def _resolve(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._done = True
            futures = list(self._futures.items())
            self._futures.clear()
        self._event.set()
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_set_future, fut)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
                pass


class _SharedFuture(asyncio.Future[None]):
    """A future many tasks await at once: one waiter's cancellation must not cancel it for the
    others (``Task.cancel`` then cancels the waiter when the future resolves)."""

    def cancel(self, msg: object = None) -> bool:  # noqa: ARG002
        return False


def _set_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True, slots=True)
class Block:
    """One durable block: ``[offset, end)`` bytes of segment ``segment``."""

    segment: int
    offset: int
    end: int
    count: int
    schema: int
    first_wall_ts: float


@dataclass(frozen=True, slots=True)
class DrainBatch:
    """Consecutive blocks of one segment and schema, drained as one insert.

    Attributes:
        stream: stream name.
        segment, start, end: the byte range ``[start, end)`` in the segment.
        count: records in the range.
        schema: the column-list version of every block in it.
        token: the ClickHouse ``insert_deduplication_token`` — a function of the spool id,
            stream and byte range, so a re-sent batch carries the same token.
    """

    stream: str
    segment: int
    start: int
    end: int
    count: int
    schema: int
    token: str


def _parse_blocks(buf: bytes | memoryview, base: int, segment: int) -> tuple[list[Block], int]:
    """Validate blocks in ``buf`` (which starts at file offset ``base``).

    Returns:
        (valid blocks, file offset just after the last valid block).
    """
    view = memoryview(buf)
    blocks: list[Block] = []
    pos = 0
    size = len(view)
    while pos + HEADER.size <= size:
        magic, schema, flags, length, count, crc, ts = HEADER.unpack_from(view, pos)
        if magic != MAGIC or count == 0 or length > MAX_BLOCK_PAYLOAD * 2:
            break
        end = pos + HEADER.size + length
        if end > size:
            break
        payload = view[pos + HEADER.size:end]
        if zlib.crc32(payload, zlib.crc32(_META.pack(schema, flags, length, count, ts))) != crc:
            break
        blocks.append(Block(segment, base + pos, base + end, count, schema, ts))
        pos = end
    return blocks, base + pos


def lock_held_elsewhere(lock_file: Path) -> bool:
    """Whether another open file description holds an ``flock`` on ``lock_file`` now (a
    non-blocking probe, released at once; False when the file does not exist). For start-up
    checks: the answer can change right after."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in _LOCK_HELD_ERRNOS
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class BatchPayload:
    """A drain batch's ``JSONCompactEachRow`` bytes as a list of views (no joined copy).

    Readable as a binary file (:meth:`read`), which is how chDB's ``raw_insert`` copies it into
    its input file; :meth:`tobytes` joins it for senders that need one buffer.
    """

    __slots__ = ("_views", "_index", "_offset", "nbytes")

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._index = 0
        self._offset = 0
        self.nbytes = sum(v.nbytes for v in views)

    def read(self, n: int = -1) -> bytes | memoryview:
        """Up to ``n`` bytes (all that is left when ``n`` < 0) from the current position;
        ``b""`` at the end. Views are returned as they are when they fit."""
        out: list[memoryview] = []
        want = self.nbytes if n is None or n < 0 else n
        while want > 0 and self._index < len(self._views):
            v = self._views[self._index]
            take = v[self._offset:self._offset + want]
            out.append(take)
            want -= take.nbytes
            self._offset += take.nbytes
            if self._offset >= v.nbytes:
                self._index += 1
                self._offset = 0
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    def tobytes(self) -> bytes:
        """All of it in one buffer (independent of the read position)."""
        return b"".join(self._views)


class SpoolStream:
    """One append-only stream of the spool (see the module docstring for the format).

    Thread-safe: :meth:`submit` from any thread or event loop; the drain methods
    (:meth:`next_batch`, :meth:`read_batch`, :meth:`begin`, :meth:`complete`) from one drain thread.

    Args:
        root: the spool directory (the stream lives in ``root / spec.name``).
        spec: the stream (name, table, columns).
        spool_id: the spool's UUID (part of every dedup token).
        clock: wall clock for the age of records.
        segment_bytes: rotate segments beyond this size.
        fsync: ``False`` only in benchmarks that measure what fsync costs.
    """

    def __init__(self, root: Path, spec: StreamSpec, *, spool_id: str, clock: Clock,
                 segment_bytes: int = 64 * 1024 * 1024, fsync: bool = True) -> None:
        self.spec = spec
        self.name = spec.name
        self.dir = root / spec.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._spool_id = spool_id
        self._clock = clock
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._mutex = threading.Lock()  # guards the pending group; C-level, cheap per append
        self._cond = threading.Condition(self._mutex)
        self._pending: list[bytes] = []
        self._pending_ts = 0.0
        self._ticket = CommitTicket()
        self._writing: CommitTicket | None = None  # the group being written and fsynced
        self._closing = False
        self._broken: str | None = None
        self._lock = threading.Lock()  # index, depth, positions
        self._index: deque[Block] = deque()
        self._depth_records = 0
        self._depth_bytes = 0
        self._inflight: DrainBatch | None = None
        self.fsyncs_total = 0
        self.write_errors_total = 0
        self.appended_total = 0
        self.corrupt_bytes_total = 0
        self._recover()
        self._thread = threading.Thread(target=self._commit_loop, name=f"kvmeter-spool-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ recovery

    def segment_path(self, seg: int) -> Path:
        """The file of segment number ``seg`` (it may not exist: drained segments are deleted)."""
        return self.dir / f"{seg:012d}{_SEGMENT_SUFFIX}"

    def _segments(self) -> list[int]:
        out = []
        for p in self.dir.iterdir():
            if p.suffix == _SEGMENT_SUFFIX and p.stem.isdigit():
                out.append(int(p.stem))
        return sorted(out)

    def _recover(self) -> None:
        state_path = self.dir / "drain.json"
        pos_seg, pos_off, inflight = 1, 0, None
        if state_path.exists():
            try:
                state = json.loads(state_path.read_text())
                pos_seg, pos_off = int(state["segment"]), int(state["offset"])
                inflight = state.get("inflight")
            except (ValueError, KeyError, TypeError) as exc:
                # drain.json is written atomically; damage means outside interference. Re-drain
                # from the oldest segment: safe, since every insert is deduplicated by key.
                log.error("spool %s: unreadable drain.json (%s); re-draining from the oldest segment", self.name, exc)
                segs = self._segments()
                pos_seg, pos_off, inflight = (segs[0] if segs else 1), 0, None
        segments = self._segments()
        for seg in segments:
            if seg < pos_seg:
                self.segment_path(seg).unlink(missing_ok=True)
        segments = [s for s in segments if s >= pos_seg]
        if not segments:
            active = pos_seg + 1 if pos_off > 0 else pos_seg
            pos_seg, pos_off = active, 0
            segments = [active]
            fd = os.open(self.segment_path(active), os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(fd)
            if self._fsync:
                _fsync_dir(self.dir)
        self._pos = (pos_seg, pos_off)
        for i, seg in enumerate(segments):
            path = self.segment_path(seg)
            start = pos_off if seg == pos_seg else 0
            data = path.read_bytes()
            if start > len(data):
                log.error("spool %s: drain position %d beyond segment %d size %d; resetting to 0",
                          self.name, start, seg, len(data))
                start = 0
                self._pos = (seg, 0)
            blocks, valid_end = _parse_blocks(memoryview(data)[start:], start, seg)
            if valid_end < len(data):
                tail = len(data) - valid_end
                if i == len(segments) - 1:
                    log.warning("spool %s: truncating a torn tail of %d bytes in segment %d (never acknowledged)",
                                self.name, tail, seg)
                else:
                    corrupt = path.with_name(f"{path.name}.corrupt-{valid_end}")
                    corrupt.write_bytes(data[valid_end:])
                    log.error("spool %s: %d damaged bytes in segment %d at %d moved to %s",
                              self.name, tail, seg, valid_end, corrupt.name)
                    self.corrupt_bytes_total += tail
                with open(path, "r+b") as fh:
                    fh.truncate(valid_end)
                    if self._fsync:
                        os.fsync(fh.fileno())
            for b in blocks:
                self._index.append(b)
                self._depth_records += b.count
                self._depth_bytes += b.end - b.offset
        self._active = segments[-1]
        self._fd = os.open(self.segment_path(self._active), os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size
        if inflight:
            batch = self._batch_from(self._first_blocks_until(int(inflight["segment"]), int(inflight["start"]),
                                                              int(inflight["end"])))
            if batch is not None and batch.end == int(inflight["end"]) and batch.token == inflight.get("token"):
                self._inflight = batch
            else:
                log.warning("spool %s: in-flight batch %s no longer matches the spool; ignoring it",
                            self.name, inflight)

    def _first_blocks_until(self, segment: int, start: int, end: int) -> list[Block]:
        out: list[Block] = []
        for b in self._index:
            if b.segment != segment or b.offset < start or b.end > end:
                break
            if out and b.schema != out[0].schema:
                break
            out.append(b)
        if not out or out[0].offset != start:
            return []
        return out

    # ------------------------------------------------------------------ append side

    def submit(self, line: bytes) -> CommitTicket:
        """Queue one encoded record (no trailing newline) for the next group commit.

        Returns at once; the returned ticket resolves when the record is fsynced.
        Raises:
            SpoolWriteError: if the stream is closed or broken (a failed truncate after an I/O error).
        """
        with self._mutex:
            if self._closing or self._broken:
                raise SpoolWriteError(f"spool stream {self.name} is {'closed' if self._closing else self._broken}")
            if not self._pending:
                self._pending_ts = self._clock.wall()
                self._cond.notify()
            self._pending.append(line)
            return self._ticket

    def submit_many(self, lines: Iterable[bytes]) -> CommitTicket:
        """Queue several encoded records in one call (same contract as :meth:`submit`)."""
        with self._cond:
            if self._closing or self._broken:
                raise SpoolWriteError(f"spool stream {self.name} is {'closed' if self._closing else self._broken}")
            if not self._pending:
                self._pending_ts = self._clock.wall()
                self._cond.notify()
            self._pending.extend(lines)
            return self._ticket

    def sync(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is durable.

        Raises:
            TimeoutError, SpoolWriteError: as :meth:`CommitTicket.wait`.
        """
        with self._cond:
            # the pending group, else the group the committer is writing right now
            ticket = self._ticket if self._pending else self._writing
        if ticket is not None and not ticket.done:
            ticket.wait(timeout)

    @property
    def pending(self) -> int:
        """Records submitted and not yet fsynced."""
        with self._cond:
            return len(self._pending)

    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                lines, ticket, ts = self._pending, self._ticket, self._pending_ts
                self._pending = []
                self._ticket = CommitTicket()
                self._writing = ticket
            try:
                self._write(lines, ts)
            except OSError as exc:
                self.write_errors_total += 1
                log.error("spool %s: group commit of %d records failed: %s", self.name, len(lines), exc)
                ticket._resolve(SpoolWriteError(
                    f"spool {self.name}: could not make {len(lines)} records durable: {exc}"))
                continue
            ticket._resolve(None)

    def _build(self, lines: list[bytes], ts: float) -> tuple[bytes, list[tuple[int, int, int]]]:
        """Encode lines into blocks; returns (bytes, [(relative offset, relative end, count)])."""
        if sum(map(len, lines)) + len(lines) <= MAX_BLOCK_PAYLOAD:
            chunks = [lines]  # the common case: one group, one block
        else:
            chunks, size = [], 0
            current: list[bytes] = []
            for line in lines:
                if current and size + len(line) + 1 > MAX_BLOCK_PAYLOAD:
                    chunks.append(current)
                    current, size = [], 0
                current.append(line)
                size += len(line) + 1
            chunks.append(current)
        parts: list[bytes] = []
        spans: list[tuple[int, int, int]] = []
        pos = 0
        for chunk in chunks:
            payload = b"\n".join(chunk) + b"\n"
            count = len(chunk)
            crc = zlib.crc32(payload, zlib.crc32(_META.pack(self.spec.schema, 0, len(payload), count, ts)))
            parts.append(HEADER.pack(MAGIC, self.spec.schema, 0, len(payload), count, crc, ts))
            parts.append(payload)
            end = pos + HEADER.size + len(payload)
            spans.append((pos, end, count))
            pos = end
        return b"".join(parts), spans

    def _write(self, lines: list[bytes], ts: float) -> None:
        data, spans = self._build(lines, ts)
        if self._size > 0 and self._size + len(data) > self._segment_bytes:
            self._rotate()
        base = self._size
        try:
            view = memoryview(data)
            written = 0
            while written < len(data):
                written += os.write(self._fd, view[written:])
            if self._fsync:
                os.fdatasync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, base)
            except OSError as exc2:
                self._broken = f"broken after a failed write and truncate ({exc2})"
            raise
        self._size = base + len(data)
        self.fsyncs_total += 1
        blocks = [Block(self._active, base + a, base + b, c, self.spec.schema, ts) for a, b, c in spans]
        with self._lock:
            self._index.extend(blocks)
            self._depth_records += len(lines)
            self._depth_bytes += len(data)
            self.appended_total += len(lines)

    def _rotate(self) -> None:
        os.close(self._fd)
        self._active += 1
        self._fd = os.open(self.segment_path(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        if self._fsync:
            _fsync_dir(self.dir)

    # ------------------------------------------------------------------ drain side

    def _batch_from(self, blocks: list[Block]) -> DrainBatch | None:
        if not blocks:
            return None
        seg, start, end = blocks[0].segment, blocks[0].offset, blocks[-1].end
        token = f"kvmeter:{self._spool_id}:{self.name}:{seg}:{start}-{end}"
        return DrainBatch(self.name, seg, start, end, sum(b.count for b in blocks), blocks[0].schema, token)

    def next_batch(self, max_records: int) -> DrainBatch | None:
        """The next batch to insert: the recovered in-flight batch if any, else up to
        ``max_records`` records (at least one block) of consecutive durable blocks in one
        segment with one schema. ``None`` when drained."""
        with self._lock:
            if self._inflight is not None:
                return self._inflight
            out: list[Block] = []
            total = 0
            for b in self._index:
                if out and (b.segment != out[0].segment or b.schema != out[0].schema
                            or total + b.count > max_records):
                    break
                out.append(b)
                total += b.count
        return self._batch_from(out)

    def read_batch(self, batch: DrainBatch) -> bytes:
        """The batch's records as ``JSONCompactEachRow`` bytes (CRC re-checked).

        Raises:
            OSError: if the segment cannot be read.
            ValueError: if a block no longer validates (disk damage since it was written).
        """
        return self.read_batch_views(batch).tobytes()

    def read_batch_views(self, batch: DrainBatch) -> "BatchPayload":
        """The batch's records (CRC re-checked) as a :class:`BatchPayload`: the blocks' payloads
        as views of the memory-mapped segment, without copying them into one buffer.

        Raises:
            OSError: if the segment cannot be read.
            ValueError: if a block no longer validates (disk damage since it was written).
        """
        with open(self.segment_path(batch.segment), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < batch.end:
                raise ValueError(f"spool {self.name}: segment {batch.segment} is {size} bytes, "
                                 f"shorter than the batch [{batch.start}, {batch.end})")
            mapped = mmap.mmap(fh.fileno(), batch.end, access=mmap.ACCESS_READ)
        view = memoryview(mapped)[batch.start:batch.end]
        blocks, valid_end = _parse_blocks(view, batch.start, batch.segment)
        if valid_end != batch.end or sum(b.count for b in blocks) != batch.count:
            raise ValueError(f"spool {self.name}: segment {batch.segment} [{batch.start}, {batch.end}) "
                             f"no longer validates (damaged at {valid_end})")
        return BatchPayload([view[b.offset - batch.start + HEADER.size:b.end - batch.start] for b in blocks])

    def quarantine(self, batch: DrainBatch) -> Path:
        """Copy a damaged batch's raw bytes aside (``.corrupt``) before it is skipped."""
        fd = os.open(self.segment_path(batch.segment), os.O_RDONLY)
        try:
            raw = os.pread(fd, batch.end - batch.start, batch.start)
        finally:
            os.close(fd)
        path = self.dir / f"{batch.segment:012d}.corrupt-{batch.start}"
        path.write_bytes(raw)
        self.corrupt_bytes_total += len(raw)
        return path

    def begin(self, batch: DrainBatch) -> None:
        """Persist the batch as in flight (range + token) before it is inserted."""
        if self._inflight is batch:
            return
        _write_json_atomic(self.dir / "drain.json", {
            "segment": self._pos[0], "offset": self._pos[1],
            "inflight": {"segment": batch.segment, "start": batch.start, "end": batch.end, "token": batch.token},
        }, fsync=self._fsync)
        with self._lock:
            self._inflight = batch

    def complete(self, batch: DrainBatch) -> None:
        """Persist that ``batch`` is in ClickHouse, drop it from the index, delete drained segments."""
        new_pos = (batch.segment, batch.end)
        _write_json_atomic(self.dir / "drain.json", {"segment": new_pos[0], "offset": new_pos[1], "inflight": None},
                           fsync=self._fsync)
        with self._lock:
            while self._index and self._index[0].segment == batch.segment and self._index[0].end <= batch.end:
                b = self._index.popleft()
                self._depth_records -= b.count
                self._depth_bytes -= b.end - b.offset
            self._inflight = None
            self._pos = new_pos
        for seg in self._segments():
            if seg < new_pos[0]:
                self.segment_path(seg).unlink(missing_ok=True)

    # ------------------------------------------------------------------ observation

    def blocks(self) -> list[Block]:
        """The durable blocks not yet drained, oldest first (a snapshot)."""
        with self._lock:
            return list(self._index)

    def depth(self) -> tuple[int, int, float | None]:
        """(durable undrained records, their bytes, first_wall_ts of the oldest or None)."""
        with self._lock:
            oldest = self._index[0].first_wall_ts if self._index else None
            return self._depth_records, self._depth_bytes, oldest

    def durable_end(self) -> tuple[int, int]:
        """(segment, offset) just past the last fsynced block."""
        with self._lock:
            if self._index:
                last = self._index[-1]
                return last.segment, last.end
            return self._pos

    def drained_position(self) -> tuple[int, int]:
        """(segment, offset) up to which everything is in ClickHouse."""
        with self._lock:
            return self._pos

    def close(self, timeout: float | None = 10.0) -> None:
        """Commit what is pending, stop the committer, close the segment."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        try:
            os.close(self._fd)
        except OSError:
            pass


class Spool:
    """A spool directory: its lock, its id and one :class:`SpoolStream` per stream spec.

    Args:
        root: directory (created if missing).
        specs: the streams to open.
        clock: wall clock for record ages.
        segment_bytes, fsync: passed to each stream.
    Raises:
        LedgerLocked: if another process (or another ``Spool`` in this one) holds the directory.
        SpoolWriteError: if the directory cannot be created or written.
    """

    @staticmethod
    def held_elsewhere(root: Path) -> bool:
        """Whether another open spool holds ``root`` now (see :func:`lock_held_elsewhere`; False
        when there is no spool there)."""
        return lock_held_elsewhere(Path(root) / "LOCK")

    def __init__(self, root: Path, specs: Iterable[StreamSpec], *, clock: Clock,
                 segment_bytes: int = 64 * 1024 * 1024, fsync: bool = True) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpoolWriteError(f"cannot open spool directory {self.root}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            if exc.errno in _LOCK_HELD_ERRNOS:
                raise LedgerLocked(
                    f"spool {self.root} is held by another process (a running `kvmeter serve`?); "
                    "read through it with --server URL --api-key KEY") from None
            raise SpoolWriteError(f"cannot lock spool {self.root}: {exc}") from exc
        try:
            os.ftruncate(self._lock_fd, 0)
            os.write(self._lock_fd, str(os.getpid()).encode())
            meta_path = self.root / "spool.json"
            if meta_path.exists():
                self.spool_id = str(json.loads(meta_path.read_text())["spool_id"])
            else:
                self.spool_id = str(uuid.uuid4())
                _write_json_atomic(meta_path, {"spool_id": self.spool_id, "format": 1}, fsync=fsync)
            self.streams: dict[str, SpoolStream] = {
                spec.name: SpoolStream(self.root, spec, spool_id=self.spool_id, clock=clock,
                                       segment_bytes=segment_bytes, fsync=fsync)
                for spec in specs
            }
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    def close(self) -> None:
        """Close every stream (committing what is pending) and release the lock."""
        for stream in self.streams.values():
            stream.close()
        self._release()
