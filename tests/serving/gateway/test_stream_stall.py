"""The stall guard of a streamed answer (``serving/gateway/stall.py``) and the response that cuts on
it (``ClosingStreamingResponse``), on a ManualClock whose sleeps advance it: no real waiting."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.serving.config import ServerSettings
from kvmeter.serving.gateway.handler import ClosingStreamingResponse, GatewaySettings
from kvmeter.serving.gateway.stall import SendGuard


def _manual() -> tuple[ManualClock, object]:
    clock = ManualClock()

    async def sleep(seconds: float) -> None:  # the watchdog's wait: the clock moves, nobody waits
        clock.advance(seconds)
        await asyncio.sleep(0)

    return clock, sleep


def _body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def test_a_send_blocked_for_the_stall_limit_is_cut_and_measured():
    clock, sleep = _manual()
    guard = SendGuard(clock, 30.0, held_kv_tokens=lambda: 1_000, sleep=sleep)
    never = asyncio.Event()

    async def stalled_reader(message: dict) -> None:  # the client's connection never drains
        await never.wait()

    send = guard.wrap(stalled_reader)
    with anyio.CancelScope() as cut:
        watchdog = asyncio.ensure_future(guard.watch(cut.cancel))
        await send(_body(b"x" * 100))
    await watchdog
    assert cut.cancelled_caught and guard.stalled
    assert 30.0 <= guard.send_blocked_s < 30.0 * 1.25  # cut between stall_s and 1.25 x stall_s
    assert guard.longest_block_s == guard.send_blocked_s
    assert guard.blocked_bytes == 100 and guard.sent_bytes == 0  # it never left
    assert guard.blocked_kv_token_s == pytest.approx(1_000 * guard.send_blocked_s)
    stats = guard.stats(Attribution(tenant_id="t", tier="free"), wall_ts=1.0)
    assert stats.stall_cut and stats.duration_s == pytest.approx(guard.send_blocked_s)


async def test_sends_that_return_at_once_are_never_cut_however_long_the_stream():
    clock, sleep = _manual()
    guard = SendGuard(clock, 30.0, sleep=sleep)

    async def reader(message: dict) -> None:
        return None

    send = guard.wrap(reader)
    watchdog = asyncio.ensure_future(guard.watch(lambda: pytest.fail("cut a stream that was read")))
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(40):  # the watchdog runs between sends: 40 x 7.5 s of stream
        await send(_body(b"data: {}\n\n"))
        await asyncio.sleep(0)
    watchdog.cancel()
    assert clock.monotonic() >= 120.0 and not guard.stalled
    assert guard.send_blocked_s == 0.0 and guard.blocked_bytes == 0 and guard.sent_bytes == 40 * 10


async def test_a_slow_send_under_the_limit_counts_as_back_pressure_without_a_cut():
    clock, sleep = _manual()
    guard = SendGuard(clock, 30.0, held_kv_tokens=lambda: 10, sleep=sleep)

    async def slow_reader(message: dict) -> None:  # drains after 5 s
        clock.advance(5.0)

    send = guard.wrap(slow_reader)
    await send(_body(b"abc"))
    assert not guard.stalled and guard.send_blocked_s == 5.0 and guard.blocked_bytes == 3
    assert guard.blocked_kv_token_s == 50.0 and guard.sent_bytes == 3


async def test_the_response_cuts_a_stalled_reader_then_closes_the_stream_like_a_disconnect():
    clock, sleep = _manual()
    guard = SendGuard(clock, 2.0, sleep=sleep)
    order: list[str] = []

    async def stream():
        try:
            for i in range(1_000):
                yield f"data: {i}\n\n".encode()
        finally:
            order.append("body closed")  # where the engine request is aborted and the usage finalized

    async def on_close() -> None:
        order.append("on_close")

    response = ClosingStreamingResponse(stream(), on_close=on_close, guard=guard,
                                        on_stall=lambda: order.append("stalled"), media_type="text/event-stream")
    never = asyncio.Event()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) > 3:  # the headers and two events went out; the client stops reading
            await never.wait()

    async def receive() -> dict:
        await never.wait()  # the client never disconnects either
        return {"type": "http.disconnect"}

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    assert order == ["stalled", "body closed", "on_close"]  # the cause is known before finalization
    assert guard.stalled and len(sent) == 4 and sent[-1].get("more_body") is True  # no end of stream


async def test_the_watchdog_has_finished_when_the_response_returns():
    """A stream that ends normally leaves no watchdog task behind (it was cancelled *and* awaited)."""
    clock, sleep = _manual()
    guard = SendGuard(clock, 30.0, sleep=sleep)

    async def stream():
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    async def on_close() -> None:
        return None

    response = ClosingStreamingResponse(stream(), on_close=on_close, guard=guard, media_type="text/event-stream")
    never = asyncio.Event()

    async def send(message: dict) -> None:
        return None

    async def receive() -> dict:
        await never.wait()
        return {"type": "http.disconnect"}

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    watchdogs = [t for t in asyncio.all_tasks() if "SendGuard.watch" in repr(t.get_coro())]
    assert watchdogs == [] and not guard.stalled


def test_the_stall_limit_is_configured_with_a_default_and_zero_turns_it_off():
    assert ServerSettings().stream_stall_timeout_s == 30.0 == GatewaySettings().stream_stall_timeout_s
    assert GatewaySettings(stream_stall_timeout_s=0).stream_stall_timeout_s is None
    assert ServerSettings(stream_stall_timeout_s=None).stream_stall_timeout_s is None
    with pytest.raises(ValueError, match="stream_stall_timeout_s"):
        GatewaySettings(stream_stall_timeout_s=-1)
    with pytest.raises(ValueError, match="stall_s"):
        SendGuard(ManualClock(), 0)
