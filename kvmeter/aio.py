"""Small asyncio helpers shared by kvmeter's background tasks."""

from __future__ import annotations

import asyncio

__all__ = ["cancel_and_wait"]


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
