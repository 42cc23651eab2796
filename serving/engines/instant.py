"""An engine that answers at once, for measuring the gateway's own cost.

It does no inference: each request yields ``max_tokens`` output tokens (cycling through a fixed
sentence of the model's own tokens) in one delta, with exact token accounting, so the gateway,
quota, scheduler and metering paths run unchanged while the engine costs nothing. Used by
``bench/quota`` (gateway ceiling) and by tests that exercise the HTTP surface without vLLM.
It is never a default for ``kvmeter serve`` (``--engine instant`` must be asked for).

A test that needs a given answer — a hermes ``<tool_call>{...}</tool_call>`` for the gateway's
tool policy, say — scripts it with ``reply``: a function of the :class:`EngineRequest` giving the
text to answer with (its tokens, at most ``max_tokens`` of them; ``finish_reason`` ``stop`` when
it all fits, ``length`` when cut), or None for the fixed sentence. A scripted engine yields one
delta per token (:attr:`InstantEngine.streams_tokens`), as a real engine streams, so vLLM's
streaming tool-call and reasoning parsers run token by token over it.

Like vLLM's engine hooks, it reports each finished request's
:class:`~kvmeter.stats.EngineRequestStats` (before the last delta reaches the caller) through
:attr:`InstantEngine.finished`: held for the caller that claimed the request, published on the
stats bus otherwise, so the ledger stores the engine-side view and ``kvmeter billing reconcile``
matches the requests it served instead of counting them as ledger-only drift.

The gateway runs vLLM's OpenAI serving layer over it too
(:class:`~kvmeter.serving.openai_api.instant_client.InstantEngineClient`, built from the model
directory without loading weights), so the gateway's measured cost includes vLLM's layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncGenerator, Callable

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.finished import FinishedStats
from kvmeter.stats import EngineLoad, EngineRequestStats
from kvmeter.tokens import TokenCounts

__all__ = ["InstantEngine"]

_TEXT = "The request is not the unit of load; tokens, KV memory and time are. "


class InstantEngine(Engine):
    """Zero-latency engine over a real tokenizer.

    Args:
        tokenizer: the model's tokenizer (used for prompt accounting and output text).
        model_name: served model name.
        max_model_len: context window in tokens.
        max_output_tokens: cap on generated tokens per request (``None``: honour max_tokens).
        bus: where each finished request's :class:`~kvmeter.stats.EngineRequestStats` is
            published (as vLLM's hooks do); ``None``: a private bus nobody reads.
        clock: gives the stats' ``wall_ts`` (epoch seconds at the finish) and their durations.
        model_dir: the model directory vLLM's serving layer is configured from (its config and
            tokenizer; no weights are loaded); default: the tokenizer's (``HFTokenizer.model_dir``).
        text: the sentence whose tokens every answer cycles through (default: kvmeter's thesis).
        reply: scripts the answer (see the module docstring): ``reply(request)`` is the text to
            answer ``request`` with, or None for the cycled sentence; default: always the sentence.
    """

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int = 8192,
                 max_output_tokens: int | None = None, *, bus: StatsBus | None = None,
                 clock: Clock = SYSTEM_CLOCK, model_dir: str | Path | None = None, text: str = _TEXT,
                 reply: Callable[[EngineRequest], str | None] | None = None) -> None:
        self._bus = bus or StatsBus()
        self.finished = FinishedStats(self._bus.publish)
        where = model_dir if model_dir is not None else getattr(tokenizer, "model_dir", None)
        self.model_dir = Path(where) if where is not None else None
        self._clock = clock
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._cap = max_output_tokens
        self._sentence = tokenizer.encode(text) or [0]
        self._reply = reply
        #: one delta per output token (a scripted ``reply``), else one delta with all of them
        self.streams_tokens = reply is not None
        self._started = False
        self.requests_total = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def argv(self) -> list[str]:
        """The ``vllm serve`` words of the model it pretends to serve (vLLM's serving layer is
        configured from them).

        Raises:
            EngineError: no model directory is known.
        """
        if self.model_dir is None:
            raise EngineError("the instant engine needs model_dir for vLLM's serving layer")
        return ["--model", str(self.model_dir), "--served-model-name", self.model_name,
                "--max-model-len", str(self.max_model_len)]

    async def start(self) -> None:
        self._started = True

    async def shutdown(self) -> None:
        self._started = False

    async def abort(self, request_id: str) -> None:
        return None

    def load(self) -> EngineLoad:
        return EngineLoad()

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """One delta with all ``max_tokens`` (capped) output tokens, ``finish_reason="length"``
        (a scripted ``reply``: its tokens up to that ceiling, ``stop`` when they all fit); its
        ``stats`` are the ones reported (:attr:`finished`) just before it is yielded.

        Raises:
            EngineError: the engine is not started.
        """
        if not self._started:
            raise EngineError("engine not started")
        started = self._clock.monotonic()
        self.requests_total += 1
        n = request.max_tokens if self._cap is None else min(request.max_tokens, self._cap)
        scripted = self._reply(request) if self._reply is not None else None
        reason = "length"
        if scripted is None:
            ids = [self._sentence[i % len(self._sentence)] for i in range(n)]
        else:
            whole = self._tokenizer.encode(scripted)
            ids = whole[:n]
            reason = "stop" if len(whole) <= n else "length"
            n = len(ids)
        prompt = len(request.prompt_token_ids)
        elapsed = max(0.0, self._clock.monotonic() - started)
        stats = EngineRequestStats(request_id=request.request_id, finish_reason=reason,
                                   tokens=TokenCounts(input_tokens=prompt, output_tokens=n), prefill_s=elapsed,
                                   inference_s=elapsed, e2e_s=elapsed, wall_ts=self._clock.wall(),
                                   attribution=request.attribution)
        if self.streams_tokens and ids:
            sent = ""
            for i in range(len(ids) - 1):  # each token's text: what decoding it adds (multi-byte safe)
                upto = self._tokenizer.decode(ids[:i + 1])
                yield EngineOutput(new_token_ids=[ids[i]], new_text=upto[len(sent):], num_output_tokens=i + 1,
                                   num_input_tokens=prompt)
                sent = upto
            self.finished.put(stats)
            yield EngineOutput(new_token_ids=[ids[-1]], new_text=self._tokenizer.decode(ids)[len(sent):],
                               num_output_tokens=n, num_input_tokens=prompt, finished=True,
                               finish_reason=reason, stats=stats)
            return
        # as vLLM's hooks: the engine's account is reported before the caller sees the finish
        self.finished.put(stats)
        yield EngineOutput(new_token_ids=ids, new_text=self._tokenizer.decode(ids),
                           num_output_tokens=n, num_input_tokens=prompt, finished=True,
                           finish_reason=reason, stats=stats)
