"""Tool calls the model emits, under the key's tool policy, before they reach the client.

A chat completion whose request declared ``tools`` may carry tool calls the model emitted. Each is
decided by :meth:`AgentRuns.on_emitted_tool_call <kvmeter.serving.agents.AgentRuns.on_emitted_tool_call>`
(tool policy, then the run store: stopped run, approval), and :class:`EmittedToolCalls` rewrites
the response accordingly:

* ``allow``: the call is handed to the client as the model emitted it;
* ``refuse`` (a blocked or not-allowed tool, a rejected approval, a stopped run, a high-risk call
  without a run id, malformed name or arguments) and ``pending_approval`` (a high-risk call: an
  approval request now exists, bound to the run, key, tool, argument digest and policy version):
  the call is **withheld** — it is not in ``tool_calls`` — and the decision's one-sentence message
  is put in its place in the choice's ``content`` (after any text the model wrote, one line per
  withheld call). A choice left with no tool calls ends with ``finish_reason`` ``stop`` instead of
  ``tool_calls``, so no client looks for a call to execute. The refusals and the pending approval
  are ledger records (``tool_calls``, ``source = 'emitted'``) and counted in
  ``kvmeter_agent_tool_calls_total{source="emitted"}`` by the hook.

Non-streaming responses are rewritten as a whole. For a stream, vLLM's layer sends a tool call as
deltas (the first with its ``id`` and ``function.name``, then ``function.arguments`` fragments;
vLLM completes the arguments in the chunk that carries the choice's ``finish_reason``). The
decision binds to the argument digest, so it needs the whole call: **every tool-call delta of a
choice is held back, and the choice's calls are decided when its ``finish_reason`` arrives** (the
only point where vLLM's parsers guarantee the arguments are complete). That chunk then carries,
in its delta, each allowed call whole (``id``, ``type``, ``function.name``, ``function.arguments``;
renumbered ``index`` 0, 1, ... among the calls handed over) and the withheld calls' messages as
``content``. Text, reasoning and logprobs deltas pass through as they come; a chunk left empty by
the hold-back is not sent. (Every chunk of such a stream is parsed: a few µs a chunk, only for
requests that declare tools under agent runs.) A stream that ends without a choice's finish (an error event, the
client leaving) hands over none of its held calls. Clients lose nothing actionable by the wait: a
tool call cannot be executed before its arguments are complete.

The rewrite works on the response's JSON (``dict``); the usage, ids and every other field stay as
vLLM's layer wrote them. Tokens the model generated for a withheld call are billed like any
other output tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator

from kvmeter.serving.agents import AgentRuns, EmittedDecision
from kvmeter.serving.tenancy import Principal

__all__ = ["EmittedToolCalls"]


@dataclass(slots=True)
class _HeldCall:
    """One streamed tool call, assembled from its deltas."""

    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class EmittedToolCalls:
    """The emitted-tool-call gate of one chat request (see the module docstring).

    Args:
        agents: the agent-run service (its hook decides each call).
        principal: the request's key.
        run_id: its ``X-Agent-Run-Id`` (``""`` when none: a high-risk call is then refused, as
            an approval is bound to a run).
    """

    def __init__(self, agents: AgentRuns, principal: Principal, run_id: str) -> None:
        self.agents = agents
        self.principal = principal
        self.run_id = run_id
        self.withheld = 0  # calls not handed to the client, this request

    async def _decide(self, name: Any, arguments: Any, call_id: Any) -> EmittedDecision:
        decision = await self.agents.on_emitted_tool_call(
            self.principal, self.run_id, name if isinstance(name, str) else "", arguments,
            call_id=call_id if isinstance(call_id, str) else "")
        if decision.action != "allow":
            self.withheld += 1
        return decision

    # -- a whole response -------------------------------------------------------------------------
    async def response(self, body: dict[str, Any]) -> dict[str, Any]:
        """Rewrite a ``chat.completion`` response (``body``, changed in place and returned)."""
        for choice in body.get("choices") or ():
            message = choice.get("message") or {}
            calls = message.get("tool_calls") or []
            if not calls:
                continue
            kept, notes = [], []
            for call in calls:
                fn = call.get("function") or {}
                decision = await self._decide(fn.get("name"), fn.get("arguments"), call.get("id"))
                if decision.action == "allow":
                    kept.append(call)
                else:
                    notes.append(decision.message)
            message["tool_calls"] = kept
            if notes:
                message["content"] = _with_notes(message.get("content"), notes)
                if not kept and choice.get("finish_reason") == "tool_calls":
                    choice["finish_reason"] = "stop"
        return body

    # -- a stream ---------------------------------------------------------------------------------
    async def stream(self, events: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        """Rewrite vLLM's SSE strings (``data: {...}\\n\\n``) of a streamed chat completion."""
        held: dict[int, dict[int, _HeldCall]] = {}  # choice index → tool-call index → call
        texted: set[int] = set()  # choices that sent content (a withheld call's note goes on a new line)
        try:
            async for event in events:
                out = await self._chunk(event, held, texted)
                if out is not None:
                    yield out
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    async def _chunk(self, event: str, held: dict[int, dict[int, _HeldCall]], texted: set[int]) -> str | None:
        prefix, sep, payload = event.partition("data: ")
        if not sep or payload.strip() == "[DONE]":
            return event
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            return event  # the usage chunk, an error event
        kept_choices = []
        changed = False
        for choice in choices:
            delta = choice.get("delta") or {}
            index = int(choice.get("index") or 0)
            calls = delta.pop("tool_calls", None)
            if calls is not None:
                changed = True
                mine = held.setdefault(index, {})
                for part in calls:
                    _absorb(mine, part)
            finish = choice.get("finish_reason")
            if finish is not None and index in held:
                changed = True
                await self._finish(choice, delta, held.pop(index), index in texted)
            if delta.get("content"):
                texted.add(index)
            if delta or choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
                choice["delta"] = delta
                kept_choices.append(choice)
        if not changed:
            return event
        if not kept_choices:
            return None
        chunk["choices"] = kept_choices
        return f"{prefix}data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def _finish(self, choice: dict[str, Any], delta: dict[str, Any], calls: dict[int, _HeldCall],
                      texted: bool) -> None:
        handed: list[dict[str, Any]] = []
        notes: list[str] = []
        for _, call in sorted(calls.items()):
            arguments = "".join(call.arguments)
            decision = await self._decide(call.name, arguments, call.id)
            if decision.action == "allow":
                handed.append({"index": len(handed), "id": call.id, "type": call.type,
                               "function": {"name": call.name, "arguments": arguments}})
            else:
                notes.append(decision.message)
        if handed:
            delta["tool_calls"] = handed
        if notes:
            delta["content"] = _with_notes(delta.get("content"), notes, texted)
            if not handed and choice.get("finish_reason") == "tool_calls":
                choice["finish_reason"] = "stop"


def _absorb(calls: dict[int, _HeldCall], part: Any) -> None:
    """Add one ``DeltaToolCall`` (a dict) to the held calls of its choice."""
    if not isinstance(part, dict):
        return
    index = part.get("index")
    index = index if isinstance(index, int) else len(calls)
    call = calls.setdefault(index, _HeldCall())
    if isinstance(part.get("id"), str) and part["id"]:
        call.id = part["id"]
    if isinstance(part.get("type"), str) and part["type"]:
        call.type = part["type"]
    fn = part.get("function") or {}
    if isinstance(fn.get("name"), str) and fn["name"] and not call.name:
        call.name = fn["name"]  # vLLM's parsers send the name whole, once
    if isinstance(fn.get("arguments"), str):
        call.arguments.append(fn["arguments"])


def _with_notes(content: Any, notes: list[str], texted: bool = False) -> str:
    """``content`` then one line per note (a new line first when text came before)."""
    text = content if isinstance(content, str) else ""
    lines = "\n".join(notes)
    return f"{text}\n{lines}" if text or texted else lines
