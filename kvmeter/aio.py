"""Small asyncio helpers shared by kvmeter's background tasks."""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Awaitable, Callable

__all__ = ["cancel_and_wait", "PeriodicTask"]


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has finished.

    The task's ``CancelledError`` is absorbed; any other exception it ends with is raised here.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class PeriodicTask:
    """A background task of the running event loop that calls ``callback`` every ``interval_s``.

    Contract:

    * Timing: the loop awaits ``sleep(interval_s)``, then calls ``callback()``, and again, until
      stopped. ``interval_s`` is seconds of ``sleep`` between the end of one call and the start of
      the next (no catch-up, no call at start: the first call is one interval after
      :meth:`start`). Whether work is *due* on an injected clock is the callback's decision.
    * Callback: takes no arguments; it may be a coroutine function (awaited on the loop) or a
      plain function (run on the loop: hand blocking work to ``asyncio.to_thread`` yourself).
    * Errors: nothing is caught here. An exception escaping the callback ends the task
      (:attr:`running` turns False) and :meth:`stop` raises it. A caller that must go on after a
      failure (log and continue) catches it inside its callback, as ``LeaseRenewer`` does.
    * :meth:`start` is idempotent: a running task is kept, a finished one is replaced.
      :meth:`stop` cancels the task and waits until it has finished (:func:`cancel_and_wait`);
      a call in progress is cancelled at its next ``await``.

    Args:
        callback: what to call each interval.
        interval_s: seconds between calls (finite, > 0).
        name: the asyncio task's name (shows in task dumps).
        sleep: the wait between calls (injectable; default ``asyncio.sleep``; tests pass one
            they control, so no test sleeps for real).
    Raises:
        ValueError: if ``interval_s`` is not a finite number > 0.
    """

    def __init__(self, callback: Callable[[], object], interval_s: float, *, name: str,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a finite number > 0 (seconds), got {interval_s!r}")
        self._callback = callback
        self.interval_s = float(interval_s)
        self.name = name
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """True while the task runs (False before :meth:`start`, after :meth:`stop`, or once the
        callback raised)."""
        return self._task is not None and not self._task.done()

    def start(self) -> asyncio.Task[None]:
        """Start the task on the running loop (idempotent) and return it.

        Raises:
            RuntimeError: when no event loop is running.
        """
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        return self._task

    async def stop(self) -> None:
        """Cancel the task and wait for it (nothing to do if it never started).

        Raises:
            Exception: the one the callback ended the task with, if it did.
        """
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await self._sleep(self.interval_s)
            result = self._callback()
            if inspect.isawaitable(result):
                await result
