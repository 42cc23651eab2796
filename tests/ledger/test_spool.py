"""The durable spool on its own: group commit, recovery from torn writes, drain positions, locking."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
from pathlib import Path

import pytest
from ledgerkit import T0, make_attempt, make_attribution, make_event

from kvmeter.clock import ManualClock
from kvmeter.ledger import InvalidRecord, LedgerLocked
from kvmeter.ledger.records import (STREAMS, USAGE_COLUMNS, USAGE_STREAM, encode_attempt, encode_engine,
                                    encode_usage)
from kvmeter.ledger.spool import HEADER, Spool
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts


def _open(root: Path, clock: ManualClock | None = None, **kw) -> Spool:
    return Spool(root, STREAMS, clock=clock or ManualClock(start_wall=T0), **kw)


def _lines(spool: Spool, name: str = "usage") -> list[bytes]:
    stream = spool.streams[name]
    out: list[bytes] = []
    while (batch := stream.next_batch(10**6)) is not None:
        out += stream.read_batch(batch).rstrip(b"\n").split(b"\n")
        stream.complete(batch)
    return out


def test_encoded_usage_event_is_a_json_array_in_column_order() -> None:
    event = make_event(1, cached_input_tokens=5, workspace_id="ws9", agent_run_id="run-7")
    row = dict(zip(USAGE_COLUMNS, json.loads(encode_usage(event)), strict=True))
    assert len(row) == len(USAGE_STREAM.columns_for(USAGE_STREAM.schema))
    # every field of the event, its attribution and its token counts is one column (flattened once)
    nested = {"attribution": event.attribution, "tokens": event.tokens}
    expected = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)
                if f.name not in ("attribution", "tokens", "reserved")}
    for obj in nested.values():
        expected.update({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    expected.update(reserved_input_tokens=25, reserved_output_tokens=64, attempt_id=event.attempt_id)
    assert row == expected
    assert (row["tenant_id"], row["workspace_id"], row["cached_input_tokens"]) == ("acme", "ws9", 5)


@pytest.mark.parametrize("change,field", [
    ({"ttft_s": math.nan}, "ttft_s"), ({"ttft_s": math.inf}, "ttft_s"), ({"event_id": "not-a-uuid"}, "event_id"),
    ({"tenant_id": 7}, "tenant_id"), ({"input_tokens": 2**33}, "input_tokens"), ({"arrival_ts": 12.0}, "arrival_ts"),
    ({"reserved": TokenCounts(output_tokens=2**32)}, "reserved_output_tokens"),
    ({"finish_ts": T0 - 10}, "finish_ts"), ({"status_code": 1000}, "status_code"), ({"model": "x" * 5000}, "model"),
])
def test_unstorable_events_are_refused_naming_the_field(change: dict, field: str) -> None:
    event = make_event(1)
    for name, value in change.items():  # bypass the types' own checks: test the ledger's layer
        owner = next((o for o in (event.attribution, event.tokens) if name in o.__dataclass_fields__), event)
        object.__setattr__(owner, name, value)
    with pytest.raises(InvalidRecord, match=field):
        encode_usage(event)


def test_attempt_and_engine_records_encode_and_validate() -> None:
    attempt = make_attempt(make_event(3), event_id="")
    row = json.loads(encode_attempt(attempt))
    assert row[1] == "00000000-0000-0000-0000-000000000000"  # no event id → nil UUID
    assert row[0] == attempt.attempt_id
    tokens = TokenCounts(input_tokens=5, cached_input_tokens=2, output_tokens=6)
    row = json.loads(encode_engine(EngineRequestStats("r1", "stop", tokens), now_wall=T0))
    assert row[2:5] == [5, 6, 2] and row[-2:] == [T0, ""]  # unattributed: tenant ""
    stamped = EngineRequestStats("r1", "stop", tokens, wall_ts=T0 + 1, attribution=make_attribution("acme"))
    assert json.loads(encode_engine(stamped, T0))[-2:] == [T0 + 1, "acme"]
    with pytest.raises(InvalidRecord, match="request_id"):
        encode_engine(EngineRequestStats("", "stop", tokens), now_wall=T0)
    with pytest.raises(InvalidRecord, match="status"):
        make_attempt(make_event(3), status="maybe")


def test_sync_waits_for_the_group_being_written(tmp_path: Path, monkeypatch) -> None:
    import os

    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    writing, release = threading.Event(), threading.Event()
    real_fdatasync = os.fdatasync

    def held_fdatasync(fd: int) -> None:  # the committer has taken and written the group, fsync pending
        writing.set()
        release.wait(30)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", held_fdatasync)
    stream.submit(encode_usage(make_event(1)))
    assert writing.wait(30)
    seen: list[int] = []
    synced = threading.Event()

    def syncer() -> None:
        stream.sync(30)
        seen.append(stream.depth()[0])
        synced.set()

    thread = threading.Thread(target=syncer)
    thread.start()
    returned_early = synced.wait(0.5)  # a bound, not timing logic: sync must still be waiting
    release.set()
    thread.join(30)
    assert not returned_early and seen == [1]  # sync returned only once the record was durable
    spool.close()


def test_group_commit_shares_fsyncs_and_everything_reads_back(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    events = [encode_usage(make_event(i)) for i in range(2000)]
    tickets = []

    def writer(chunk: list[bytes]) -> None:
        for line in chunk:
            tickets.append(stream.submit(line))

    threads = [threading.Thread(target=writer, args=(events[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ticket in set(tickets):
        ticket.wait(10)
    assert stream.fsyncs_total < len(events)  # records shared fsyncs
    assert stream.depth()[0] == len(events)
    assert sorted(_lines(spool)) == sorted(events)
    spool.close()


async def test_async_waiters_share_one_future_and_survive_a_cancelled_neighbour(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    ticket = stream.submit(encode_usage(make_event(1)))
    waiters = [asyncio.ensure_future(ticket.wait_async()) for _ in range(50)]
    waiters[0].cancel()
    done = await asyncio.gather(*waiters, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    assert all(d is None for d in done[1:])
    assert ticket.done
    spool.close()


def test_a_torn_tail_is_truncated_and_earlier_records_survive(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    stream.submit_many([encode_usage(make_event(i)) for i in range(10)]).wait(10)
    stream.submit_many([encode_usage(make_event(i)) for i in range(10, 20)]).wait(10)
    segment = sorted((tmp_path / "usage").glob("*.wal"))[-1]
    spool.close()
    data = segment.read_bytes()
    # simulate a crash in the middle of writing a third group: a full header and half a payload
    segment.write_bytes(data + data[:HEADER.size + 40])
    spool = _open(tmp_path)
    assert segment.stat().st_size == len(data)
    assert len(_lines(spool)) == 20
    spool.close()


def test_a_corrupted_block_stops_recovery_there(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    first = [encode_usage(make_event(i)) for i in range(5)]
    stream.submit_many(first).wait(10)
    stream.submit_many([encode_usage(make_event(i)) for i in range(5, 10)]).wait(10)
    spool.close()
    segment = sorted((tmp_path / "usage").glob("*.wal"))[-1]
    data = bytearray(segment.read_bytes())
    data[-5] ^= 0xFF  # flip a bit in the last block's payload: its CRC no longer matches
    segment.write_bytes(bytes(data))
    spool = _open(tmp_path)
    assert _lines(spool) == first
    spool.close()


def test_drain_position_and_in_flight_batch_survive_a_restart(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    stream.submit_many([encode_usage(make_event(i)) for i in range(10)]).wait(10)
    stream.submit_many([encode_usage(make_event(i)) for i in range(10, 20)]).wait(10)
    first = stream.next_batch(10)
    assert first.count == 10
    stream.begin(first)
    stream.complete(first)
    second = stream.next_batch(100)
    stream.begin(second)  # "crash" after marking it in flight, before the insert was confirmed
    spool.close()
    spool = _open(tmp_path)
    again = spool.streams["usage"].next_batch(5)  # a smaller limit: the in-flight range still wins
    assert (again.segment, again.start, again.end, again.token) == \
        (second.segment, second.start, second.end, second.token)
    assert again.count == 10
    spool.close()


def test_segments_rotate_and_drained_segments_are_deleted(tmp_path: Path) -> None:
    spool = _open(tmp_path, segment_bytes=1024 * 1024)
    stream = spool.streams["usage"]
    big = [encode_usage(make_event(i, key=f"k{i}")) for i in range(6000)]  # ~0.26 MB per 1,000
    for i in range(0, 6000, 500):
        stream.submit_many(big[i:i + 500]).wait(10)
    segments = sorted((tmp_path / "usage").glob("*.wal"))
    assert len(segments) >= 2
    assert len(_lines(spool)) == 6000
    assert len(sorted((tmp_path / "usage").glob("*.wal"))) == 1  # only the active one is left
    spool.close()


def test_one_process_holds_a_spool(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    with pytest.raises(LedgerLocked, match="--server"):
        _open(tmp_path)
    spool.close()
    _open(tmp_path).close()  # released on close


def test_age_of_the_oldest_record_reads_the_injected_clock(tmp_path: Path) -> None:
    clock = ManualClock(start_wall=T0)
    spool = _open(tmp_path, clock=clock)
    stream = spool.streams["usage"]
    stream.submit(encode_usage(make_event(1))).wait(10)
    clock.advance(30)
    stream.submit(encode_usage(make_event(2))).wait(10)
    count, size, oldest = stream.depth()
    assert count == 2 and size > 0 and clock.wall() - oldest == 30
    spool.close()


def test_a_failed_fsync_fails_that_group_only_and_the_segment_stays_valid(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    from kvmeter.ledger import SpoolWriteError

    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    stream.submit(encode_usage(make_event(1))).wait(10)
    real = os.fdatasync
    calls = {"n": 0}

    def full_disk(fd: int) -> None:  # the disk fills up during the second group's fsync
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full_disk)
    with pytest.raises(SpoolWriteError, match="No space left"):
        stream.submit(encode_usage(make_event(2))).wait(10)
    monkeypatch.setattr(os, "fdatasync", real)
    stream.submit(encode_usage(make_event(3))).wait(10)
    assert calls["n"] == 1 and stream.write_errors_total == 1
    spool.close()
    spool = _open(tmp_path)  # the failed group was cut from the segment: 1 and 3 remain, intact
    assert [json.loads(line)[2] for line in _lines(spool)] == ["acme-r1", "acme-r3"]
    spool.close()


def test_batch_views_read_back_in_any_chunk_size_and_damage_after_write_is_refused(tmp_path: Path) -> None:
    spool = _open(tmp_path)
    stream = spool.streams["usage"]
    lines = [encode_usage(make_event(i)) for i in range(300)]
    for i in range(0, 300, 50):  # six groups → six blocks
        stream.submit_many(lines[i:i + 50]).wait(10)
    batch = stream.next_batch(10**6)
    expected = b"\n".join(lines) + b"\n"
    for size in (1, 7, 4096, len(expected), -1):
        payload = stream.read_batch_views(batch)
        assert payload.nbytes == len(expected)
        got = bytearray()
        while chunk := payload.read(size):
            assert size < 0 or len(chunk) <= size
            got += chunk
        assert bytes(got) == expected == payload.tobytes()
    # a byte flipped inside the third block after it was written: the drain refuses the batch
    block = stream.blocks()[2]
    seg = stream.segment_path(block.segment)
    data = bytearray(seg.read_bytes())
    data[block.offset + HEADER.size + 5] ^= 0x20
    seg.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="no longer validates"):
        stream.read_batch_views(batch)
    spool.close()
