"""An upstream OpenAI-compatible answer, read for metering and shaped for the client (``--engine remote``).

Two small parts, no I/O (:mod:`kvmeter.serving.gateway.remote_path` does the HTTP):

* :class:`AnswerReader` reads the upstream's chunks (or its whole JSON answer) and keeps what the
  bill needs: the usage blocks, each choice's ``finish_reason``, the tokens of the text each choice
  streamed, an error event, ``[DONE]``.
* :class:`ClientView` gives the client the upstream's stream as it was sent, except what kvmeter
  added to the request: with ``stream_options.include_usage`` added by kvmeter, the usage-only
  chunk is dropped, a ``usage`` key on other chunks removed, and the ``system_fingerprint`` that
  vLLM then puts on the usage chunk instead of on each choice's last chunk put back there. The
  fingerprint is a constant of the upstream, learnt from its usage chunks and whole answers; until
  it is known (a process's first such stream) a choice's last chunk waits for the usage chunk,
  so with ``n`` > 1 it can reach the client after other choices' chunks (each chunk still names
  its choice).

**Which usage is billed** (issue 15 item 4). Usage blocks can come in several shapes, and none of
them ends the stream (every chunk is forwarded, to ``[DONE]``):

* the final usage chunk (``choices: []``, OpenAI's and vLLM's ``include_usage``): the whole
  answer's counts — billed as they are;
* running usage on each chunk of one choice (vLLM's ``continuous_usage_stats``: completion tokens
  so far *of that choice*, the prompt's tokens): the last one seen per choice counts, so 40 prompt
  tokens with running completion 0, 1, …, 7 bill 40 / 7, never the first chunk's 0;
* usage on a chunk that also carries text (one choice: as running usage; several: a running total
  of the answer);
* usage that arrives before the last text chunk: the latest block counts, the text after it is
  forwarded.

Without a final block the bill is, per choice, its latest running usage, else the tokens of the
text it streamed (the model's tokenizer on each delta's text: ``content``, ``reasoning_content``,
tool-call names and arguments, or a completion's ``text``), and the prompt's tokens from the
usage when it gave them for a single prompt, else kvmeter's own count of the prompt; the event's
``token_source`` then says ``estimate`` unless upstream usage covered every count
(:meth:`AnswerReader.exact`). ``finish_reason`` is the upstream's (``length`` is a normal end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from kvmeter.tokens import TokenCounts

__all__ = ["AnswerReader", "ClientView", "parse_usage", "DONE", "UNKNOWN"]

#: The payload of the SSE event that ends an OpenAI stream.
DONE = "[DONE]"


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: A system fingerprint not seen yet (``None`` is a known "the upstream sends none").
UNKNOWN: Any = _Unknown()


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def parse_usage(value: Any) -> TokenCounts | None:
    """An OpenAI ``usage`` object as token counts: ``prompt_tokens`` → input, ``completion_tokens``
    → output, ``prompt_tokens_details.cached_tokens`` → cached input (clamped to the input),
    ``completion_tokens_details.reasoning_tokens`` → reasoning (clamped to the output).

    Returns:
        None when ``value`` is not a usage object (null, or ``prompt_tokens`` /
        ``completion_tokens`` missing or not integers ≥ 0): such a block bills nothing.
    """
    if not isinstance(value, dict):
        return None
    prompt, completion = _int(value.get("prompt_tokens")), _int(value.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    details = value.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    details = value.get("completion_tokens_details")
    reasoning = _int(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    return TokenCounts(input_tokens=prompt, cached_input_tokens=min(cached or 0, prompt),
                       output_tokens=completion, reasoning_tokens=min(reasoning or 0, completion))


def _pieces(choice: dict[str, Any]) -> list[str]:
    """The pieces of generated text a choice of a chunk (or of a whole answer) carries."""
    part = choice.get("delta")
    if not isinstance(part, dict):
        part = choice.get("message")
    if not isinstance(part, dict):
        text = choice.get("text")
        return [text] if isinstance(text, str) and text else []
    pieces = [part.get("content"), part.get("reasoning_content"), part.get("reasoning")]
    for call in part.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            pieces += [fn.get("name"), fn.get("arguments")]
    return [p for p in pieces if isinstance(p, str) and p]


@dataclass(slots=True)
class AnswerReader:
    """What one upstream answer says about its tokens (see the module docstring).

    Args:
        count_text: tokens of a piece of generated text (the model's tokenizer).
        input_estimate: kvmeter's count of the request's input tokens (all its prompts).
        single_prompt: the request has one prompt (a chat, or a completion of one prompt), so a
            running usage block's ``prompt_tokens`` is the whole input.
    """

    count_text: Callable[[str], int]
    input_estimate: int
    single_prompt: bool = True
    #: the final usage block (a chunk without choices, or a whole answer's ``usage``)
    final: TokenCounts | None = None
    #: running usage: choice index → latest completion tokens of that choice
    running: dict[int, int] = field(default_factory=dict)
    #: a running total over several choices (usage on a chunk with several choices)
    running_total: int | None = None
    #: the prompt tokens of the latest running usage block
    running_input: int | None = None
    #: choice index → tokens counted in the text it streamed
    counted: dict[int, int] = field(default_factory=dict)
    #: choice index → its finish_reason, as the upstream sent it
    finish_reasons: dict[int, str] = field(default_factory=dict)
    #: the error object of an error event, if the upstream sent one
    error: Any = None
    #: ``[DONE]`` arrived
    done: bool = False

    # -- reading -------------------------------------------------------------------------------
    def on_event(self, payload: Any) -> None:
        """One SSE event's parsed ``data`` (``DONE`` for ``[DONE]``; a chunk object; anything
        else is ignored)."""
        if payload == DONE:
            self.done = True
            return
        if not isinstance(payload, dict):
            return
        choices = payload.get("choices")
        if "error" in payload and not choices:
            self.error = payload["error"]
            return
        choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        for choice in choices:
            index = self._index(choice)
            pieces = _pieces(choice)
            if pieces:
                self.counted[index] = self.counted.get(index, 0) + sum(self.count_text(p) for p in pieces)
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reasons[index] = choice["finish_reason"]
        usage = parse_usage(payload.get("usage"))
        if usage is None:
            return
        if not choices:
            self.final = usage
        elif len(choices) == 1:
            self.running[self._index(choices[0])] = usage.output_tokens
            self.running_input = usage.input_tokens
        else:
            self.running_total = usage.output_tokens
            self.running_input = usage.input_tokens

    def on_answer(self, body: Any) -> None:
        """A whole (non-streamed) answer: its ``usage`` is the final block."""
        if not isinstance(body, dict):
            return
        for choice in body.get("choices") or ():
            if isinstance(choice, dict):
                index = self._index(choice)
                self.counted[index] = sum(self.count_text(p) for p in _pieces(choice))
                if isinstance(choice.get("finish_reason"), str):
                    self.finish_reasons[index] = choice["finish_reason"]
        self.final = parse_usage(body.get("usage"))

    @staticmethod
    def _index(choice: dict[str, Any]) -> int:
        index = choice.get("index")
        return index if type(index) is int else 0

    # -- what it says ----------------------------------------------------------------------------
    @property
    def output_tokens(self) -> int:
        """The output tokens so far: the final block's, else the running total, else per choice its
        running usage or its counted text."""
        if self.final is not None:
            return self.final.output_tokens
        if self.running_total is not None:
            return self.running_total
        choices = set(self.running) | set(self.counted)
        return sum(self.running.get(i, self.counted.get(i, 0)) for i in choices)

    @property
    def input_tokens(self) -> int:
        """The input tokens: the final block's, else a running block's (one prompt), else kvmeter's
        own count."""
        if self.final is not None:
            return self.final.input_tokens
        if self.running_input is not None and self.single_prompt:
            return self.running_input
        return self.input_estimate

    def tokens(self) -> TokenCounts:
        """The counts to bill now (cached and reasoning tokens only from a final block)."""
        if self.final is not None:
            return self.final
        return TokenCounts(input_tokens=self.input_tokens, output_tokens=self.output_tokens)

    def exact(self) -> bool:
        """Did upstream usage give every count :meth:`tokens` bills (else they are estimates)?"""
        if self.final is not None:
            return True
        if self.running_input is None or not self.single_prompt:
            return False
        return self.running_total is not None or set(self.counted) <= set(self.running)

    def finish_reason(self) -> str | None:
        """The first choice's finish_reason (the lowest index that has one)."""
        return self.finish_reasons[min(self.finish_reasons)] if self.finish_reasons else None

    def all_finished(self, choices: int) -> bool:
        """Have ``choices`` choices (0, 1, … choices − 1) sent their finish_reason?"""
        return len(self.finish_reasons) >= choices


class ClientView:
    """The client's view of the upstream's stream (see the module docstring).

    Args:
        strip_usage: kvmeter added ``stream_options.include_usage`` to the request (the client
            did not ask for usage); False: every event goes to the client unchanged.
        fingerprint: the upstream's ``system_fingerprint`` if known from an earlier stream, else
            :data:`UNKNOWN`; read :attr:`fingerprint` afterwards for what this stream taught.
    """

    def __init__(self, strip_usage: bool, fingerprint: Any = UNKNOWN) -> None:
        self.strip_usage = strip_usage
        self.fingerprint = fingerprint
        self._held: list[dict[str, Any]] = []  # last chunks of choices, until the fingerprint is known

    def event(self, raw: bytes, payload: Any) -> list[bytes]:
        """The events to send now for one upstream event (``raw``: its bytes, blank line
        included; ``payload``: its parsed ``data``)."""
        if not self.strip_usage:
            if isinstance(payload, dict) and payload.get("choices") == [] and "usage" in payload:
                fp = payload.get("system_fingerprint")  # learnt for the streams that strip it
                self.fingerprint = fp if isinstance(fp, str) else None
            return [raw]
        if payload == DONE:
            return [*self.release(), raw]
        if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
            return [raw]
        if not payload["choices"]:
            if "usage" not in payload:
                return [raw]
            # the usage chunk kvmeter asked for: not the client's; it carries the fingerprint
            fp = payload.get("system_fingerprint")
            self.fingerprint = fp if isinstance(fp, str) else None
            return self.release()
        changed = payload.pop("usage", UNKNOWN) is not UNKNOWN
        last = any(isinstance(c, dict) and c.get("finish_reason") is not None for c in payload["choices"])
        if last and "system_fingerprint" not in payload:
            if self.fingerprint is UNKNOWN:
                self._held.append(payload)
                return []
            if self.fingerprint is not None:
                payload["system_fingerprint"] = self.fingerprint
                changed = True
        return [_sse(payload)] if changed else [raw]

    def release(self) -> list[bytes]:
        """The held chunks, with the fingerprint if known (at the usage chunk, ``[DONE]`` or the
        stream's end)."""
        held, self._held = self._held, []
        if isinstance(self.fingerprint, str):
            for chunk in held:
                chunk["system_fingerprint"] = self.fingerprint
        return [_sse(chunk) for chunk in held]


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
