"""The engine boundary: one small abstract class, several implementations.

Implementations: :mod:`kvmeter.serving.engines.vllm_engine` (vLLM ``AsyncLLM`` in-process, CPU or
GPU build), ``remote`` (an external OpenAI-compatible server) and ``instant`` (answers at once; for
measuring the gateway's own ceiling). The simulator's replica adapter,
:class:`kvmeter.serving.simulator.engine.SimEngine`, lives with the simulator.

The gateway hands an engine fully tokenized requests (it tokenizes once, for quota estimation), and
reads back :class:`EngineOutput` deltas. The engine reports its token counts as the source of truth.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncGenerator, Sequence

from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.stats import EngineLoad, EngineRequestStats

__all__ = [
    "Engine",
    "EngineRequest",
    "EngineOutput",
    "EngineError",
    "Tokenizer",
]


class EngineError(RuntimeError):
    """The engine failed a request or could not start. ``retryable`` hints at a transient fault."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(slots=True)
class EngineRequest:
    """A tokenized generation request.

    Attributes:
        request_id: kvmeter's unique id; the engine must keep it unchanged in its stats.
        prompt_token_ids: the prompt after the chat template, as token ids (length ≥ 1).
        max_tokens: output ceiling (≥ 1).
        min_tokens: hold the output to at least this many tokens (0 = off; vLLM extension).
        ignore_eos: keep generating past EOS (vLLM extension; used by trace replays).
        temperature: sampling temperature ≥ 0 (0 = greedy).
        top_p: nucleus sampling mass in (0, 1].
        stop: stop strings (the matched string is not returned).
        seed: sampling seed or ``None``.
        priority: engine priority, lower runs first (vLLM's ``priority`` scheduling policy);
            set from the tier by the scheduler.
        attribution: the request's :class:`~kvmeter.attribution.Attribution`; the engine stamps it
            on the :class:`~kvmeter.stats.EngineRequestStats` it publishes (the simulator also
            attributes its work to ``attribution.tenant_id``).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    priority: int = 0
    attribution: Attribution = UNATTRIBUTED


@dataclass(slots=True)
class EngineOutput:
    """One delta from the engine.

    Attributes:
        new_token_ids: output token ids produced since the previous delta (may be empty).
        new_text: detokenized text of those tokens ("" if the engine does not detokenize).
        num_output_tokens: cumulative output tokens generated so far (engine-true).
        num_input_tokens: input tokens of the request: its prompt (engine-true).
        num_cached_input_tokens: input tokens served from the prefix cache (⊆ input; 0 if unknown).
        finished: True on the last delta.
        finish_reason: on the last delta: ``stop``, ``length``, ``abort`` or ``error``.
        stats: on the last delta, the engine's own per-request account when it has one (vLLM's
            ``FinishedRequestStats`` via the engine hooks); ``None`` otherwise (remote). A stream
            closed before its last delta gets its account from :meth:`Engine.final_stats`.
    """

    new_token_ids: Sequence[int]
    new_text: str
    num_output_tokens: int
    num_input_tokens: int
    num_cached_input_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stats: EngineRequestStats | None = None


class Tokenizer(abc.ABC):
    """The model's tokenizer as the gateway uses it (counting and prompt synthesis)."""

    @abc.abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the model's BOS etc. as its own
        server would for a completion prompt."""

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat after the model's chat template, with the generation prompt.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        Raises:
            ValueError: if the template cannot render the messages.
        """

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids."""


class Engine(abc.ABC):
    """An inference engine the gateway and scheduler drive.

    Lifecycle: ``await start()`` once, then any number of concurrent :meth:`generate` calls, then
    ``await shutdown()``.
    """

    #: The model name clients use in ``"model"``.
    model_name: str
    #: The context window in tokens (input + output must fit).
    max_model_len: int
    #: The directory of the weights this process computes with, or ``None`` (the remote engine
    #: computes elsewhere; the instant engine computes nothing). The self-checks count the model's
    #: parameters from it for their physical bounds (:mod:`kvmeter.serving.selfcheck.bounds`).
    weights_dir: Path | None = None
    #: Tokens per block of the engine's prefix cache, when the engine reports each request's
    #: prefix-cache hits (its outputs' ``num_cached_input_tokens``) in whole blocks of it: vLLM's
    #: ``cache_config.block_size`` once started (with the prefix cache disabled too: every hit is
    #: then 0). ``None`` (remote, instant, simulated): no such report, and the gateway's re-prefill
    #: signal (:mod:`kvmeter.serving.gateway.reprefill`) is off.
    prefix_cache_block_size_tokens: int | None = None

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the served model."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model / connect. Raises :class:`EngineError` when it cannot."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release the engine; idempotent."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream :class:`EngineOutput` deltas; the last has ``finished=True``.

        Closing the iterator early (client gone) must abort the request in the engine.
        Raises:
            EngineError: if the engine fails the request.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a running request (no-op if unknown or already finished)."""

    async def final_stats(self, request_id: str, timeout_s: float = 2.0) -> EngineRequestStats | None:
        """The engine's own account of a request that ended — finished, aborted (its
        :meth:`generate` stream closed early) or failed — waiting up to ``timeout_s`` seconds
        (≥ 0) for it to arrive.

        A consumer that closed a stream early awaits this for the engine-true counts of the work
        done (an abort's account comes with the engine's next step). The default, for an engine
        that keeps no accounts (remote, instant, simulated): ``None`` at once, and the consumer
        bills what the outputs it received carried.
        """
        return None

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """The latest load snapshot (cheap; no I/O)."""
