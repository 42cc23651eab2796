"""An ``EngineClient`` over kvmeter's instant engine, for vLLM's serving layer without inference.

vLLM's serving classes need an engine client with a ``VllmConfig``, a renderer (chat template and
tokenizer) and an input processor. :func:`render_only_config` builds them from the model
directory without loading weights — what vLLM's own render-only server does
(``vllm/entrypoints/launchers/render``) — and :class:`InstantEngineClient` answers ``generate``
at once with ``RequestOutput`` objects made from the instant engine's deltas: each of ``n``
sequences is one :meth:`~kvmeter.serving.engines.instant.InstantEngine.generate` call
(``max_tokens`` tokens of its fixed sentence, exact counts, its finished stats reported as vLLM's
hooks report them), with a log-probability of 0 for each token when ``logprobs`` (or prompt
logprobs) are asked for. Stop strings, structured outputs and sampling parameters do not change
what it answers. An instant engine with a scripted ``reply`` (``streams_tokens``) is streamed
token by token instead (for ``n`` = 1), as a real engine streams, so vLLM's streaming parsers
(tool calls, reasoning) see one token per delta. So ``--engine instant`` runs the same serving
layer, metering and ledger as ``--engine vllm``, and the gateway's measured cost includes vLLM's
layer.
"""

from __future__ import annotations

import threading
from typing import Any, AsyncIterator, Sequence

from kvmeter.serving.engines.base import EngineError, EngineRequest

__all__ = ["InstantEngineClient", "render_only_config"]

_CONFIGS: dict[tuple[str, ...], tuple[Any, Any, Any]] = {}
_CONFIGS_LOCK = threading.Lock()


def render_only_config(args: Any) -> tuple[Any, Any, Any]:
    """``(VllmConfig, renderer, InputProcessor)`` for the model of vLLM's parsed ``args``, without
    an engine or weights (as vLLM's render-only server builds them; cached per model directory,
    served name, context window and parsers: the renderer loads the tokenizer, seconds)."""
    key = (str(args.model), repr(args.served_model_name), str(args.max_model_len), str(args.tokenizer),
           str(args.reasoning_parser), str(args.trust_remote_code))
    with _CONFIGS_LOCK:
        found = _CONFIGS.get(key)
        if found is not None:
            return found
        from vllm import envs
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # preprocessing only: no quantized kernels
        saved = envs.VLLM_CPU_KVCACHE_SPACE
        envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache is allocated (silences the CPU warning)
        try:
            vllm_config = VllmConfig(model_config=model_config,
                                     logging_config=engine_args.create_logging_config(),
                                     structured_outputs_config=engine_args.create_structured_outputs_config())
        finally:
            envs.VLLM_CPU_KVCACHE_SPACE = saved
        renderer = renderer_from_config(vllm_config)
        found = _CONFIGS[key] = (vllm_config, renderer, InputProcessor(vllm_config, renderer))
        return found


class InstantEngineClient:
    """vLLM's ``EngineClient`` protocol over an :class:`~kvmeter.serving.engines.instant.InstantEngine`.

    Args:
        engine: the instant engine (its subclasses' ``generate`` is what runs).
        args: vLLM's parsed arguments for the model (:func:`render_only_config`).
    """

    def __init__(self, engine: Any, args: Any) -> None:
        self._engine = engine
        self.vllm_config, self.renderer, self.input_processor = render_only_config(args)
        self.model_config = self.vllm_config.model_config
        self.errored = False
        self.dead_error = EngineError("the instant engine is not running")
        self.is_running = True
        self.is_stopped = False

    # -- what vLLM's serving classes call ----------------------------------------------------
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        return None

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return False

    async def check_health(self) -> None:
        return None

    async def do_log_stats(self) -> None:
        return None

    async def abort(self, request_id: str | Sequence[str]) -> None:
        return None

    def get_kv_event_sources(self) -> dict:
        return {}

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *,
                       priority: int = 0, **_: Any) -> AsyncIterator[Any]:
        """One finished ``RequestOutput`` with ``sampling_params.n`` choices, each the instant
        engine's answer to the prompt's token ids (see the module docstring).

        Raises:
            EngineError: the instant engine failed (or is not started).
        """
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(prompt["prompt_token_ids"])
        want_logprobs = sampling_params.logprobs is not None
        if int(sampling_params.n or 1) == 1 and getattr(self._engine, "streams_tokens", False):
            # a scripted reply: one RequestOutput per token, as an engine streams them
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            request = EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                    max_tokens=int(sampling_params.max_tokens or 1),
                                    min_tokens=int(sampling_params.min_tokens or 0),
                                    ignore_eos=bool(sampling_params.ignore_eos), priority=priority)
            ids: list[int] = []
            text = ""
            async for out in self._engine.generate(request):
                ids.extend(out.new_token_ids)
                text += out.new_text
                new_ids = list(out.new_token_ids) if delta else list(ids)
                logprobs = [{t: Logprob(0.0, 1)} for t in new_ids] if want_logprobs else None
                choice = CompletionOutput(index=0, text=out.new_text if delta else text, token_ids=new_ids,
                                          cumulative_logprob=0.0 if want_logprobs else None, logprobs=logprobs,
                                          finish_reason=out.finish_reason if out.finished else None)
                yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
                                    prompt_logprobs=None, outputs=[choice], finished=out.finished,
                                    num_cached_tokens=0)
            return
        outputs = []
        for index in range(int(sampling_params.n or 1)):
            request = EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                    max_tokens=int(sampling_params.max_tokens or 1),
                                    min_tokens=int(sampling_params.min_tokens or 0),
                                    ignore_eos=bool(sampling_params.ignore_eos), priority=priority)
            ids = []
            text = ""
            reason = "length"
            async for out in self._engine.generate(request):
                ids.extend(out.new_token_ids)
                text += out.new_text
                reason = out.finish_reason or reason
            logprobs = [{t: Logprob(0.0, 1)} for t in ids] if want_logprobs else None
            outputs.append(CompletionOutput(index=index, text=text, token_ids=ids,
                                            cumulative_logprob=0.0 if want_logprobs else None,
                                            logprobs=logprobs, finish_reason=reason))
        prompt_logprobs = None
        if sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [{t: Logprob(0.0, 1)} for t in prompt_ids[1:]]
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
                            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=True,
                            num_cached_tokens=0)

    def shutdown(self, timeout: float | None = None) -> None:
        return None
