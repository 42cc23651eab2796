"""Loop and retry-storm detection over one agent run's permitted tool calls and model calls.

The thresholds are the tier's :class:`~kvmeter.serving.tenancy.limits.LoopStops`; the state lives
in the run store (:mod:`.memory`, :mod:`.redis_store`, whose Lua scripts implement the same
functions, operation for operation). Three stops:

* **identical tool calls** — permits of the same *signature* (tool name and argument digest) in
  the run; the call that would be permit number ``max_identical_tool_calls + 1`` stops the run.
* **tool cycles** — with the run's permitted signatures newest first ``h[0], h[1], ...`` (``h[0]``
  the call being decided), the *repeats* of period ``p`` are the length of the run of calls from
  the newest for which ``h[i] == h[i + p]``, counted only when the block ``h[0 .. p-1]`` holds at
  least two different signatures (a block of one signature is an identical-call loop). A → B → A
  has one repeat of period 2, A → B → A → B two, A → B → C → A one of period 3. The largest over
  ``p = 2 .. max_cycle_length`` above ``max_cycle_repeats`` stops the run.
* **repeated prompts** — model calls in a row with the same prompt digest, none of them followed by
  a permitted tool call; the call that would be number ``max_repeated_prompts + 1`` stops the run.
"""

from __future__ import annotations

from typing import Sequence

from kvmeter.stats import RUN_STOP_REASONS

__all__ = ["cycle_repeats", "signature", "STOP_REASONS", "identical_detail", "cycle_detail", "prompt_detail"]

#: Why a run was stopped (the ``reason`` of the stop, its metric label and ledger record).
STOP_REASONS = RUN_STOP_REASONS


def signature(tool: str, arguments_sha256: str) -> str:
    """A tool call's signature: the tool name and the first 32 hex digits of its argument digest."""
    return f"{tool}#{arguments_sha256[:32]}"


def cycle_repeats(history: Sequence[str], max_length: int) -> tuple[int, int]:
    """The longest back-to-back repetition of a block of 2..``max_length`` calls at the newest end.

    Args:
        history: signatures, newest first (``history[0]`` is the call being decided).
        max_length: the longest block considered (≥ 2).
    Returns:
        ``(repeats, period)``: the most repeats over every period (see the module docstring) and
        the period that has them (the shortest on a tie); ``(0, 0)`` when there is none.
    """
    best, best_p = 0, 0
    n = len(history)
    for p in range(2, max_length + 1):
        if n <= p or len(set(history[:p])) < 2:
            continue
        r = 0
        while r + p < n and history[r] == history[r + p]:
            r += 1
        if r > best:
            best, best_p = r, p
    return best, best_p


def identical_detail(tool: str, limit: int) -> str:
    """The stop's detail for an identical-call loop."""
    return f"tool {tool!r} was called with the same arguments more than {limit} times in this run"


def cycle_detail(tool: str, period: int, limit: int) -> str:
    """The stop's detail for a cycle of ``period`` calls ending with ``tool``."""
    return (f"a cycle of {period} tool calls ending with {tool!r} repeated more than {limit} calls "
            "back to back")


def prompt_detail(limit: int) -> str:
    """The stop's detail for a repeated-prompt retry storm."""
    return f"the same prompt was sent more than {limit} times in a row with no tool call between"
