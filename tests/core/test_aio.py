"""kvmeter.aio.PeriodicTask: timing on a sleep the test opens by hand (nothing sleeps for real)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvmeter.aio import PeriodicTask

GUARD_S = 5.0  # a hang guard only: every wait below is released by the test itself


class GatedSleep:
    """An injected ``sleep``: records what it was asked and returns only when the test opens it."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self._gate: asyncio.Queue[None] = asyncio.Queue()
        self.waiting = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.waiting.set()
        await self._gate.get()
        self.waiting.clear()

    def open(self) -> None:
        self._gate.put_nowait(None)

    async def parked(self) -> None:
        """Wait until the loop sits in its sleep again."""
        await asyncio.wait_for(self.waiting.wait(), GUARD_S)


async def _next(calls: asyncio.Queue[int]) -> int:
    return await asyncio.wait_for(calls.get(), GUARD_S)


async def test_each_call_follows_one_interval_of_sleep_and_none_comes_at_start():
    sleep, calls = GatedSleep(), asyncio.Queue[int]()
    n = 0

    async def callback() -> None:
        nonlocal n
        n += 1
        calls.put_nowait(n)

    periodic = PeriodicTask(callback, 2.5, name="t", sleep=sleep)
    periodic.start()
    await sleep.parked()
    assert calls.empty() and sleep.asked == [2.5]          # started: sleeping, not called
    for expected in (1, 2, 3):
        sleep.open()
        assert await _next(calls) == expected
        await sleep.parked()
    assert sleep.asked == [2.5] * 4 and periodic.running
    await periodic.stop()
    assert not periodic.running and calls.empty()


async def test_a_plain_function_is_called_too():
    sleep, calls = GatedSleep(), asyncio.Queue[int]()
    periodic = PeriodicTask(lambda: calls.put_nowait(1), 1.0, name="t", sleep=sleep)
    periodic.start()
    sleep.open()
    assert await _next(calls) == 1
    await periodic.stop()


async def test_an_exception_in_the_callback_ends_the_task_and_stop_raises_it():
    sleep = GatedSleep()

    def callback() -> None:
        raise RuntimeError("boom")

    periodic = PeriodicTask(callback, 1.0, name="t", sleep=sleep)
    task = periodic.start()
    sleep.open()
    await asyncio.wait({task}, timeout=GUARD_S)
    assert task.done() and not periodic.running and sleep.asked == [1.0]   # no second interval
    with pytest.raises(RuntimeError, match="boom"):
        await periodic.stop()
    await periodic.stop()                                   # the failure is reported once


async def test_start_is_idempotent_and_a_stopped_task_starts_anew():
    sleep = GatedSleep()
    periodic = PeriodicTask(lambda: None, 1.0, name="kvmeter-test-tick", sleep=sleep)
    await periodic.stop()                                   # never started: nothing to do
    first = periodic.start()
    assert periodic.start() is first and first.get_name() == "kvmeter-test-tick"
    await sleep.parked()
    await periodic.stop()                                   # cancelled in its sleep
    assert first.cancelled() and not periodic.running
    second = periodic.start()
    assert second is not first and periodic.running
    await periodic.stop()


def test_start_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        PeriodicTask(lambda: None, 1.0, name="t").start()


@pytest.mark.parametrize("interval_s", [0.0, -1.0, math.inf, math.nan])
def test_the_interval_must_be_finite_and_positive(interval_s: float):
    with pytest.raises(ValueError, match="interval_s"):
        PeriodicTask(lambda: None, interval_s, name="t")
