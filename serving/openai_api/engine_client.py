"""kvmeter around the engine client vLLM's serving layer calls: every ``RequestOutput`` metered.

vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion`` call ``engine_client.generate(prompt,
sampling_params, request_id, ...)`` once per engine input (one prompt; a completions prompt list
has several) and read ``RequestOutput`` objects back. :class:`MeteredEngineClient` is that engine
client: it delegates everything to the real one (vLLM's ``AsyncLLM``, or the instant engine's
client) and, while the gateway has a :class:`BoundRequest` bound to the running task (a context
variable), runs each ``generate`` call as one of kvmeter's engine requests:

* the engine request id is kvmeter's own (:attr:`BoundRequest.engine_ids`: the request id, or
  ``<request id>-<i>`` for the i-th of several engine inputs), never the one vLLM derived from the
  client's ``X-Request-Id`` — ids stay unique when clients reuse theirs;
* the engine priority is the scheduler's grant (the tier's), not the body's ``priority``; the
  client's ``X-data-parallel-rank`` is dropped (kvmeter places requests);
* each ``RequestOutput`` is counted (input tokens once per engine request, output tokens of every
  choice — ``n`` > 1 included — as the engine counts them: ``RequestOutputKind.DELTA`` outputs
  add up, cumulative ones replace) and handed to the request's meter as one running total, and
  the new output tokens are charged to the scheduler. A non-streaming request (vLLM asks for
  ``FINAL_ONLY``) runs as ``CUMULATIVE`` — the engine reports every step, so a request aborted
  mid-way bills what the engine generated — and vLLM's layer still gets only the final output,
  every choice in it, as ``FINAL_ONLY`` gives it;
* when an engine request finishes, its finished stats are taken from the engine
  (:class:`~kvmeter.serving.engines.finished.FinishedStats`, claimed under the request's
  attribution, which it stamps on every report — vLLM's hooks know only ids; one per sequence,
  ``n`` for ``n`` choices); when the last one finishes, they are merged into one engine record
  for the logical request (:func:`merge_stats`), stamped with the request's attribution,
  published, and the gateway's ``on_done`` makes the usage event durable — all before the final
  output reaches vLLM's layer, so before the usage chunk, ``[DONE]`` or the JSON response.

A ``generate`` call that ends early (the client left: the gateway closes the generators,
:meth:`BoundRequest.aclose`; or the engine failed) closes the engine's stream, which aborts the
engine request, and releases its stats claim; the gateway then bills what the meter counted.
One the engine refused before running it (:func:`refused_before_run`: vLLM's input processor
raised a client error from ``AsyncLLM.add_request``, before the request reached the engine core)
is :attr:`BoundRequest.refused`: its engine id is taken back from the ids the gateway asks the
engine to account for (no account will ever come), and the gateway records a client refusal.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

import anyio

from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.events import Outcome
from kvmeter.serving.engines.base import EngineOutput
from kvmeter.serving.engines.finished import FinishedStats, merge_stats
from kvmeter.stats import EngineRequestStats

__all__ = ["MeteredEngineClient", "BoundRequest", "merge_stats", "bound_request", "refused_before_run"]

_BOUND: contextvars.ContextVar["BoundRequest | None"] = contextvars.ContextVar("kvmeter_bound_request",
                                                                               default=None)


def bound_request() -> "BoundRequest | None":
    """The request bound to the running task (None outside the gateway's OpenAI path)."""
    return _BOUND.get()


def refused_before_run(exc: BaseException) -> bool:
    """Is ``exc``, raised by vLLM's ``AsyncLLM.generate`` before its first output, the engine
    refusing the request before running it? vLLM re-raises its client errors
    (``VLLMClientError``: ``VLLMValidationError`` and the others its server answers 4xx, and a
    ``GracefulHTTPError`` with a 4xx status) only from ``add_request``, where its input processor
    checks the request before handing it to the engine core; anything else it wraps as an engine
    error (``EngineGenerateError``, ``EngineDeadError``)."""
    try:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
    except ImportError:  # pragma: no cover — vLLM is a dependency of this path
        return False
    if isinstance(exc, VLLMClientError):
        return True
    return isinstance(exc, GracefulHTTPError) and 400 <= int(exc.http_status) < 500


@dataclass(slots=True)
class _EngineRequest:
    """One ``generate`` call's counts."""

    engine_id: str
    n: int
    delta: bool  # RequestOutputKind.DELTA: each output carries only what is new
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    token_ids: dict[int, list[int]] | None = None  # kept only to count reasoning tokens
    finish_reason: str | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason
    finished: bool = False
    stats: list[EngineRequestStats] | None = None
    refused: bool = False  # the engine refused it before running it (refused_before_run)


class BoundRequest:
    """kvmeter's side of one admitted request while vLLM's serving layer runs it.

    Args:
        request_id: kvmeter's request id (the engine ids derive from it).
        engine_inputs: how many ``generate`` calls the request makes (its rendered prompts).
        meter: the request's meter (``on_output(EngineOutput) -> new output tokens``, and a
            ``reasoning_tokens`` attribute set here).
        charge: called with each batch of new output tokens (the scheduler's charge).
        priority: the engine priority to run at (the scheduler's grant).
        finished: the engine's finished-stats store (None: the meter's own counts are billed).
        publish: where the merged engine record goes (the stats bus).
        on_done: awaited with ``"ok"`` (or ``"error"``: an engine sequence finished with
            ``error``) once every engine request finished and its stats are in.
        reasoning: counts the reasoning tokens among a choice's output token ids (vLLM's
            parser's ``count_reasoning_tokens``), or None when no reasoning parser is configured.
        stats_wait_s: the longest a finished engine request waits for its stats (seconds).
        rendered: the render kvmeter already did for ``request`` (handed to vLLM's layer once, so
            the prompt is rendered and tokenized once), and ``request`` that object.
        started: a list the engine id of each ``generate`` call is appended to when it starts
            (the gateway asks the engine for the account of each after an early end).
        attribution: the request's attribution, stamped on its engine requests' stats (the
            merged record and any abort account the engine reports after an early end).
    """

    def __init__(self, *, request_id: str, engine_inputs: int, meter: Any, charge: Callable[[int], None],
                 priority: int, finished: FinishedStats | None,
                 publish: Callable[[EngineRequestStats], None],
                 on_done: Callable[[Outcome], Awaitable[object]],
                 reasoning: Callable[[Sequence[int]], int] | None = None, stats_wait_s: float = 2.0,
                 request: object = None, rendered: object = None, started: list[str] | None = None,
                 attribution: Attribution = UNATTRIBUTED) -> None:
        self.request_id = request_id
        self.attribution = attribution
        self.engine_ids = [request_id] if engine_inputs <= 1 else [f"{request_id}-{i}" for i in range(engine_inputs)]
        self.meter = meter
        self.priority = priority
        self.request = request
        self.rendered = rendered
        self._charge = charge
        self._finished = finished
        self._publish = publish
        self._on_done = on_done
        self._reasoning = reasoning
        self._stats_wait_s = stats_wait_s
        self._started = started  # the caller's list of engine ids handed to the engine
        self._calls: list[_EngineRequest] = []
        self._generators: list[AsyncGenerator[Any, None]] = []
        self._output_total = 0
        self._input_total = 0
        self._cached_input_total = 0
        self.failed: BaseException | None = None
        #: the engine's refusal of a ``generate`` call before it ran (:func:`refused_before_run`)
        self.refused: BaseException | None = None
        self.done = False
        self._token: contextvars.Token | None = None

    # -- binding ------------------------------------------------------------------------------
    def bind(self) -> None:
        """Make this the request of the running task (and of the tasks it starts)."""
        self._token = _BOUND.set(self)

    def unbind(self) -> None:
        if self._token is not None:
            try:
                _BOUND.reset(self._token)
            except ValueError:  # reset from another context: the binding dies with its task
                pass
            self._token = None

    def take_render(self, request: object) -> object | None:
        """The render kvmeter did for ``request``, once (None for any other request object)."""
        if request is self.request and self.rendered is not None:
            rendered, self.rendered = self.rendered, None
            return rendered
        return None

    # -- engine requests ----------------------------------------------------------------------
    def start(self, sampling_params: Any) -> _EngineRequest:
        """Begin the next ``generate`` call: its engine id, its stats claimed."""
        index = len(self._calls)
        engine_id = self.engine_ids[index] if index < len(self.engine_ids) else f"{self.request_id}-{index}"
        from vllm.sampling_params import RequestOutputKind

        call = _EngineRequest(engine_id, int(sampling_params.n or 1),
                              sampling_params.output_kind == RequestOutputKind.DELTA,
                              token_ids={} if self._reasoning is not None else None)
        self._calls.append(call)
        if self._started is not None:
            self._started.append(engine_id)
        if self._finished is not None:
            self._finished.claim(engine_id, self.attribution)
        return call

    def track(self, generator: AsyncGenerator[Any, None]) -> None:
        """Remember a ``generate`` generator, so :meth:`aclose` can end it."""
        self._generators.append(generator)

    def account(self, call: _EngineRequest, out: Any) -> None:
        """Count one ``RequestOutput`` of ``call`` and hand the running totals to the meter."""
        if out.prompt_token_ids is not None and not call.input_tokens:
            call.input_tokens = len(out.prompt_token_ids)
            self._input_total += call.input_tokens
        cached = int(out.num_cached_tokens or 0)
        if cached != call.cached_input_tokens:
            self._cached_input_total += cached - call.cached_input_tokens
            call.cached_input_tokens = cached
        counts = call.output_tokens
        for choice in out.outputs:
            i = choice.index
            got = len(choice.token_ids)
            before = counts.get(i, 0)
            now = before + got if call.delta else got
            counts[i] = now
            self._output_total += now - before
            if call.token_ids is not None and got:
                if call.delta:
                    call.token_ids.setdefault(i, []).extend(choice.token_ids)
                else:  # cumulative: the engine's own growing list (read at the end only)
                    call.token_ids[i] = choice.token_ids
            if choice.finish_reason is not None:
                call.finish_reasons[i] = choice.finish_reason
                if i == 0:
                    call.finish_reason = choice.finish_reason
        new = self.meter.on_output(self._totals())
        if new:
            self._charge(new)

    def _totals(self, *, finished: bool = False, stats: EngineRequestStats | None = None,
                finish_reason: str | None = None) -> EngineOutput:
        return EngineOutput(new_token_ids=(), new_text="", num_output_tokens=self._output_total,
                            num_input_tokens=self._input_total,
                            num_cached_input_tokens=min(self._cached_input_total, self._input_total),
                            finished=finished, finish_reason=finish_reason, stats=stats)

    async def finish(self, call: _EngineRequest) -> None:
        """``call``'s engine request finished: take its stats; after the last one, close the
        meter's engine view and make the usage event durable (``on_done``)."""
        call.finished = True
        if self._finished is not None:
            call.stats = await self._finished.take(call.engine_id, call.n, self._stats_wait_s)
        if self.done or len(self._calls) < len(self.engine_ids) or not all(c.finished for c in self._calls):
            return
        self.done = True
        merged = None
        complete = [c.stats for c in self._calls if c.stats is not None and len(c.stats) >= c.n]
        if len(complete) == len(self._calls):  # every call's sequences have their stats
            merged = merge_stats(self.request_id, complete)
            merged.attribution = self.attribution
            self._publish(merged)
        first = self._calls[0]
        reason = merged.finish_reason if merged is not None else first.finish_reason
        self.meter.on_output(self._totals(finished=True, stats=merged, finish_reason=reason))
        self.count_reasoning()
        errored = any(c.finish_reason == "error" for c in self._calls)
        await self._on_done("error" if errored else "ok")

    def fail(self, call: _EngineRequest, exc: BaseException) -> None:
        """``call`` ended without finishing (aborted or failed): release its stats claim."""
        if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) and self.failed is None:
            self.failed = exc
        if self._finished is not None and not call.finished:
            self._finished.release(call.engine_id)

    def refuse(self, call: _EngineRequest, exc: BaseException) -> None:
        """The engine refused ``call`` before running it: no engine request exists, so no account
        of it will come; its id leaves the gateway's list of started ids, its stats claim is released."""
        call.refused = True
        if self.refused is None:
            self.refused = exc
        if self._started is not None and call.engine_id in self._started:
            self._started.remove(call.engine_id)
        if self._finished is not None:
            self._finished.release(call.engine_id)

    @property
    def unrun(self) -> bool:
        """Did the engine refuse every ``generate`` call of the request before running it (so no
        engine work happened: the request is a client refusal)?"""
        return bool(self._calls) and all(c.refused for c in self._calls)

    def finish_reasons(self) -> tuple[str | None, ...]:
        """Each choice's finish reason as the engine gave it, in the answer's choice order (the
        engine inputs in order, then each one's ``n`` choices); None for a choice that did not finish."""
        return tuple(call.finish_reasons.get(i) for call in self._calls for i in range(call.n))

    def count_reasoning(self) -> None:
        """Set the meter's reasoning tokens from what every choice generated so far."""
        if self._reasoning is None:
            return
        total = 0
        for call in self._calls:
            for ids in (call.token_ids or {}).values():
                total += int(self._reasoning(tuple(ids)))
        self.meter.reasoning_tokens = total

    async def aclose(self) -> None:
        """End every ``generate`` call still open (aborting its engine request); shielded."""
        with anyio.CancelScope(shield=True):
            for generator in self._generators:
                try:
                    await generator.aclose()
                except RuntimeError:  # still running in a task being cancelled: it ends itself
                    pass


class MeteredEngineClient:
    """The engine client vLLM's serving layer gets: the real one (``inner``), metered.

    Every attribute but :meth:`generate` is the inner client's.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def inner(self) -> Any:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        """vLLM's ``EngineClient.generate``; metered for the bound request (see the module)."""
        bound = _BOUND.get()
        if bound is None:
            return self._inner.generate(prompt, sampling_params, request_id, **kwargs)
        generator = self._metered(bound, prompt, sampling_params, kwargs)
        bound.track(generator)
        return generator

    async def _metered(self, bound: BoundRequest, prompt: Any, sampling_params: Any,
                       kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        from vllm.sampling_params import RequestOutputKind

        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        if final_only:  # see the module docstring (vLLM built these parameters for this call)
            sampling_params.output_kind = RequestOutputKind.CUMULATIVE
        latest: dict[int, Any] = {}
        call = bound.start(sampling_params)
        kwargs["priority"] = bound.priority
        kwargs["data_parallel_rank"] = None
        stream = self._inner.generate(prompt, sampling_params, call.engine_id, **kwargs)
        outputs = 0
        try:
            async for out in stream:
                outputs += 1
                bound.account(call, out)
                if final_only:
                    for choice in out.outputs:
                        latest[choice.index] = choice
                    if not out.finished:
                        continue
                    out.outputs = [latest[i] for i in sorted(latest)]  # FINAL_ONLY's aggregate
                if out.finished:
                    await bound.finish(call)
                yield out
        except BaseException as exc:
            if not outputs and refused_before_run(exc):
                bound.refuse(call, exc)
            else:
                bound.fail(call, exc)
            raise
        finally:
            if not call.finished and not call.refused:
                bound.fail(call, GeneratorExit())
                # closing the engine's stream aborts its request (AsyncLLM.generate does on
                # GeneratorExit); shielded so a cancelled caller still frees the engine's KV
                with anyio.CancelScope(shield=True):
                    await stream.aclose()  # vLLM's generate is an async generator
