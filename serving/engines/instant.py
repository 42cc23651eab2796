"""An engine that answers at once, for measuring the gateway's own cost.

It does no inference: each request yields ``max_tokens`` output tokens (cycling through a fixed
sentence of the model's own tokens) in one delta, with exact token accounting, so the gateway,
quota, scheduler and metering paths run unchanged while the engine costs nothing. Used by
``bench/quota`` (gateway ceiling) and by tests that exercise the HTTP surface without vLLM.
It is never a default for ``kvmeter serve`` (``--engine instant`` must be asked for).
"""

from __future__ import annotations

from typing import AsyncIterator

from kvmeter.serving.engines.base import (Engine, EngineError, EngineLoad, EngineOutput,
                                          EngineRequest, Tokenizer)
from kvmeter.stats import EngineRequestStats

__all__ = ["InstantEngine"]

_TEXT = "The request is not the unit of load; tokens, KV memory and time are. "


class InstantEngine(Engine):
    """Zero-latency engine over a real tokenizer.

    Args:
        tokenizer: the model's tokenizer (used for prompt accounting and output text).
        model_name: served model name.
        max_model_len: context window in tokens.
        max_output_tokens: cap on generated tokens per request (``None``: honour max_tokens).
    """

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int = 8192,
                 max_output_tokens: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._cap = max_output_tokens
        self._sentence = tokenizer.encode(_TEXT) or [0]
        self._started = False
        self.requests_total = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    async def start(self) -> None:
        self._started = True

    async def shutdown(self) -> None:
        self._started = False

    async def abort(self, request_id: str) -> None:
        return None

    def load(self) -> EngineLoad:
        return EngineLoad()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._started:
            raise EngineError("engine not started")
        self.requests_total += 1
        n = request.max_tokens if self._cap is None else min(request.max_tokens, self._cap)
        ids = [self._sentence[i % len(self._sentence)] for i in range(n)]
        prompt = len(request.prompt_token_ids)
        stats = EngineRequestStats(request_id=request.request_id, finish_reason="length",
                                   prompt_tokens=prompt, generation_tokens=n)
        yield EngineOutput(new_token_ids=ids, new_text=self._tokenizer.decode(ids),
                           num_output_tokens=n, num_prompt_tokens=prompt, finished=True,
                           finish_reason="length", stats=stats)
