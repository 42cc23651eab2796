"""vLLM's OpenAI serving layer, in-process, for the gateway: validate, render, plan, create.

:class:`OpenAILayer` holds vLLM's own serving objects — ``OpenAIServingChat``,
``OpenAIServingCompletion`` and ``OpenAIServingModels``, built by vLLM's ``init_app_state`` from
one ``Namespace`` of ``vllm serve`` arguments (:func:`layer_args`) over a
:class:`~kvmeter.serving.openai_api.engine_client.MeteredEngineClient` — and gives the gateway the
steps of kvmeter's request flow in its order:

1. :meth:`OpenAILayer.validate`: the body as vLLM's pydantic request model (its errors answered
   as vLLM's server answers them), plus kvmeter's one refusal: ``use_beam_search`` (vLLM's beam
   search runs one engine request per beam per output token, which kvmeter cannot reserve for).
2. :meth:`OpenAILayer.render`: the model check and the render (chat template, tools in the
   template, tokenization) — once: vLLM's layer gets this render back when it runs the request
   (:class:`_RenderOnce`, through the bound request).
3. :meth:`OpenAILayer.plan`: each engine input's prompt tokens and output ceiling (vLLM's own
   ``get_max_tokens``, so defaults match vLLM's), the sampling parameters checked as vLLM checks
   them (a bad one is refused before any quota is reserved), and the estimate: prompt tokens
   summed over the engine inputs, output tokens ``n`` × the ceilings' sum. "As vLLM checks them"
   includes the checks vLLM's engine makes only when the request reaches ``AsyncLLM.add_request``
   (its input processor's ``_validate_params``: ``logprobs`` / ``top_logprobs`` /
   ``prompt_logprobs`` past ``max_logprobs``, ``logit_bias``, ``stop_token_ids`` or
   ``allowed_token_ids`` outside the vocabulary, ...): refused here, they are client errors
   answered at once, as any other 400 before admission, not engine failures after it.
4. :meth:`OpenAILayer.create`: ``create_chat_completion`` / ``create_completion``.

:class:`OpenAIApi` builds the layer once, when first needed, for ``--engine vllm`` (over its
``AsyncLLM``) and ``--engine instant`` (over
:class:`~kvmeter.serving.openai_api.instant_client.InstantEngineClient`).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeGuard

from kvmeter.serving.engines.base import Engine
from kvmeter.serving.engines.vllm_args import ServingFlags, parse_vllm_argv, serving_argv
from kvmeter.serving.openai_api.engine_client import MeteredEngineClient, bound_request
from kvmeter.serving.openai_api.errors import (from_error_response, from_exception, from_validation_error,
                                               unsupported)

if TYPE_CHECKING:
    from kvmeter.serving.engines.instant import InstantEngine
    from kvmeter.serving.engines.vllm_engine import VllmEngine

__all__ = ["OpenAIApi", "OpenAILayer", "Plan", "layer_args", "request_kind", "validate_request"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What a validated, rendered request will ask of the engine.

    Attributes:
        input_tokens: the input tokens of each engine input (one per prompt).
        max_tokens: each engine input's output ceiling (tokens, ≥ 1).
        n: sequences per engine input.
    """

    input_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    n: int

    @property
    def total_input_tokens(self) -> int:
        return sum(self.input_tokens)

    @property
    def total_output_tokens(self) -> int:
        """The most output tokens the request can generate: ``n`` × Σ ceilings."""
        return self.n * sum(self.max_tokens)

    @property
    def longest_sequence(self) -> tuple[int, int]:
        """``(prompt tokens, output ceiling)`` of the engine input whose sum is largest — one
        sequence's context, what a quota's ``max_context_tokens`` limits; ``(0, 0)`` without inputs."""
        return max(zip(self.input_tokens, self.max_tokens, strict=True), key=sum, default=(0, 0))


class _RenderOnce:
    """vLLM's ``OnlineRenderer`` as a serving object sees it: a request the gateway already
    rendered gets that render back (from the bound request, once); anything else is rendered."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def render_chat(self, request: Any) -> Any:
        bound = bound_request()
        done = bound.take_render(request) if bound is not None else None
        return done if done is not None else await self._inner.render_chat(request)

    async def render_completion(self, request: Any) -> Any:
        bound = bound_request()
        done = bound.take_render(request) if bound is not None else None
        return done if done is not None else await self._inner.render_completion(request)


#: Every serving flag at its default (ServingFlags is frozen, so one shared instance is a safe default).
_DEFAULT_FLAGS = ServingFlags()


def layer_args(engine_argv: Sequence[str], flags: ServingFlags) -> Any:
    """vLLM's ``Namespace`` for the serving layer: the engine's ``vllm serve`` words, then the
    serving flags (these win).

    Raises:
        VllmArgsError: vLLM refuses the arguments.
    """
    args = parse_vllm_argv([*engine_argv, *serving_argv(flags)])
    # vLLM's parser hands every Namespace the same default StructuredOutputsConfig object: merge the
    # reasoning parser into a copy, or it would leak into every later layer of the process
    args.structured_outputs_config = copy.copy(args.structured_outputs_config)
    if args.reasoning_parser:  # what AsyncEngineArgs.create_structured_outputs_config() merges
        args.structured_outputs_config.reasoning_parser = args.reasoning_parser
    return args


def request_kind(chat: bool) -> Any:
    """vLLM's pydantic request model: ``ChatCompletionRequest`` (``chat``) or ``CompletionRequest``."""
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def validate_request(data: dict, chat: bool) -> Any:
    """``data`` as vLLM's ``ChatCompletionRequest`` (``chat``) or ``CompletionRequest`` — what
    vLLM's own server checks a body with — plus kvmeter's two refusals. Used by both completion
    paths (the in-process layer, and the remote proxy before it forwards a body).

    Raises:
        OpenAIError: vLLM's 400 for a body its model refuses; kvmeter's 400 naming
            ``max_completion_tokens`` on ``/v1/completions`` or ``use_beam_search``.
    """
    from pydantic import ValidationError

    try:
        request = request_kind(chat).model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except Exception as exc:  # noqa: BLE001 — a validator's own error: vLLM's answer for it
        raise from_exception(exc) from None
    if not chat and data.get("max_completion_tokens") is not None:
        # vLLM ignores it there (not a completions field), which would silently run to
        # max_tokens (default 16) instead of the ceiling the client asked for
        raise unsupported("max_completion_tokens is a chat completions parameter; /v1/completions "
                          "takes max_tokens", "max_completion_tokens")
    if request.use_beam_search:
        raise unsupported("use_beam_search is not supported by this gateway: beam search runs an "
                          "engine request per beam and output token, which kvmeter cannot "
                          "reserve quota for; sample with n and best-of selection on the client",
                          "use_beam_search")
    return request


class OpenAILayer:
    """vLLM's serving objects for one engine client (see the module docstring)."""

    def __init__(self, state: Any, client: MeteredEngineClient, args: Any,
                 supported_tasks: tuple[str, ...] = ("generate",)) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        self.state = state
        self.client = client
        self.args = args
        self.chat = state.openai_serving_chat
        self.completion = state.openai_serving_completion
        self.models = state.openai_serving_models
        for serving in (self.chat, self.completion):
            serving.online_renderer = _RenderOnce(serving.online_renderer)
        self._error_response = ErrorResponse
        self.model_config = client.model_config
        self.max_model_len = int(self.model_config.max_model_len)
        self.request_id_headers = bool(args.enable_request_id_headers)
        self.reasoning = bool(args.structured_outputs_config.reasoning_parser)
        #: the engine's tasks, as its input processor checks a request's parameters against them
        self.supported_tasks = tuple(supported_tasks)

    @classmethod
    async def build(cls, inner_client: Any, args: Any) -> "OpenAILayer":
        """vLLM's ``init_app_state`` over ``MeteredEngineClient(inner_client)`` with ``args``.

        Raises:
            Exception: what vLLM raises for an unusable setting (an unknown tool-call parser, ...).
        """
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        client = MeteredEngineClient(inner_client)
        state = State()
        tasks = tuple(await inner_client.get_supported_tasks())
        # MeteredEngineClient proxies vLLM's EngineClient (__getattr__) rather than subclassing its ABC
        await init_app_state(client, state, args, tasks)  # type: ignore[arg-type]
        return cls(state, client, args, tasks)

    def serving(self, chat: bool) -> Any:
        return self.chat if chat else self.completion

    # -- step 1 ---------------------------------------------------------------------------------
    def validate(self, data: dict, chat: bool) -> Any:
        """:func:`validate_request` (vLLM's request model, kvmeter's two refusals)."""
        return validate_request(data, chat)

    # -- step 2 ---------------------------------------------------------------------------------
    async def render(self, request: Any, chat: bool) -> Any:
        """The model check and the render: ``(conversation, engine_inputs)`` for a chat,
        ``engine_inputs`` for a completion.

        Raises:
            OpenAIError: vLLM's 404 for an unknown model, 400 for what its renderer refuses
                (a prompt past the context window, an empty conversation, a tool_choice naming no
                tool, ...).
        """
        serving = self.serving(chat)
        try:
            if chat:
                result = await serving.render_chat_request(request)
            else:
                result = await serving.render_completion_request(request)
        except Exception as exc:  # noqa: BLE001 — vLLM's server answers each through its handlers
            raise from_exception(exc) from None
        if isinstance(result, self._error_response):
            raise from_error_response(result)
        return result

    @staticmethod
    def engine_inputs(rendered: Any, chat: bool) -> list[Any]:
        return list(rendered[1] if chat else rendered)

    # -- step 3 ---------------------------------------------------------------------------------
    def plan(self, request: Any, rendered: Any, chat: bool, context_limit: int | None = None) -> Plan:
        """Prompt tokens, output ceilings and ``n`` of a rendered request (see the module).

        ``context_limit``: the caller's tightest quota limit on prompt + output tokens; a request
        that sets no output ceiling gets one that fits it (its ``max_tokens`` is set on
        ``request``), so it is not refused for a reservation it never asked for.

        Raises:
            OpenAIError: vLLM's 400 for a sampling parameter it refuses (``n`` with greedy
                sampling, a negative temperature, ``min_tokens`` > ``max_tokens``, ...), its
                serving layer's or its engine's input processor's (:meth:`_check_params`:
                ``top_logprobs`` past ``max_logprobs``, a ``logit_bias`` id outside the
                vocabulary, ...).
        """
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        serving = self.serving(chat)
        inputs = self.engine_inputs(rendered, chat)
        prompts = tuple(serving._extract_prompt_len(ei) for ei in inputs)
        window = self.max_model_len
        fields = request.__dict__  # (reading max_tokens as an attribute warns it is deprecated)
        asked = fields.get("max_completion_tokens") if chat else None
        if asked is None:
            asked = fields.get("max_tokens")
        if asked is None and context_limit is not None and context_limit < window and prompts:
            asked = request.max_tokens = max(1, min(context_limit - p for p in prompts))
        try:
            for engine_input in inputs:  # what the engine's input processor checks (token ids in
                self._check_input(engine_input)  # the vocabulary, ...), before anything is reserved
            ceilings = tuple(get_max_tokens(window, asked, p, serving.default_sampling_params,
                                            serving.override_max_tokens,
                                            truncate_prompt_tokens=request.truncate_prompt_tokens)
                             for p in prompts)
            params = request.to_sampling_params(min(ceilings) if ceilings else 1,
                                                serving.default_sampling_params)
            self._check_params(params)
        except Exception as exc:  # noqa: BLE001 — vLLM raises these from create_*; same answer
            raise from_exception(exc) from None
        return Plan(input_tokens=prompts, max_tokens=ceilings, n=int(params.n or 1))

    def _check_params(self, params: Any) -> None:
        """The engine's own check of the sampling parameters (its input processor's
        ``_validate_params``, which ``AsyncLLM.add_request`` runs before the request reaches the
        engine core), run here on ``params`` (a throw-away copy vLLM's layer rebuilds when it runs
        the request) so that what it refuses is refused before admission.

        Raises:
            VLLMValidationError: a parameter the engine refuses (``ValueError`` for a few).
        """
        check = getattr(self.client.input_processor, "_validate_params", None)
        if check is None:
            return
        if getattr(params, "structured_outputs", None) is not None:  # the check marks its backend on
            params.structured_outputs = copy.copy(params.structured_outputs)  # it: never the request's
        check(params, self.supported_tasks)

    def _check_input(self, engine_input: Any) -> None:
        check = getattr(self.client.input_processor, "_validate_model_input", None)
        if check is not None:
            check(engine_input, "decoder")
        elif engine_input.get("prompt_token_ids"):
            self.client.renderer.validate_token_ids(engine_input["prompt_token_ids"])

    def reasoning_counter(self, request: Any, chat: bool) -> Callable[[Sequence[int]], int] | None:
        """Counts a choice's reasoning tokens as vLLM's chat layer does (its parser's
        ``count_reasoning_tokens``); None without a reasoning parser (or for completions)."""
        chat_serving = self.chat
        if not chat or not self.reasoning or chat_serving.parser_cls is None:
            return None
        tokenizer = chat_serving.renderer.tokenizer

        def count(token_ids: Sequence[int]) -> int:
            parser = chat_serving._make_parser(request, tokenizer,
                                               chat_serving._effective_chat_template_kwargs(request))
            return int(parser.count_reasoning_tokens(tuple(token_ids)))

        return count

    # -- step 4 ---------------------------------------------------------------------------------
    async def create(self, request: Any, raw_request: Any, chat: bool) -> Any:
        """vLLM's ``create_chat_completion`` / ``create_completion``: an ``ErrorResponse``, a
        response object, or an async generator of SSE strings."""
        if chat:
            return await self.chat.create_chat_completion(request, raw_request)
        return await self.completion.create_completion(request, raw_request)

    def is_error(self, result: Any) -> bool:
        return isinstance(result, self._error_response)


class OpenAIApi:
    """The gateway's handle on vLLM's serving layer for an in-process engine, built once.

    Args:
        engine: a :class:`~kvmeter.serving.engines.vllm_engine.VllmEngine` or
            :class:`~kvmeter.serving.engines.instant.InstantEngine`.
        flags: the serving flags (:class:`~kvmeter.serving.engines.vllm_args.ServingFlags`).
    Raises:
        VllmArgsError: vLLM refuses the arguments (checked here, before the engine loads).
    """

    def __init__(self, engine: VllmEngine | InstantEngine, flags: ServingFlags = _DEFAULT_FLAGS) -> None:
        self.engine = engine
        self.flags = flags
        self.args = layer_args(engine.argv, flags)
        self.request_id_headers = bool(self.args.enable_request_id_headers)
        self._layer: OpenAILayer | None = None
        self._lock = asyncio.Lock()

    @staticmethod
    def supports(engine: Engine) -> TypeGuard[VllmEngine | InstantEngine]:
        """Does ``engine`` run vLLM's serving layer in-process (vllm and instant: yes)?"""
        from kvmeter.serving.engines.instant import InstantEngine
        from kvmeter.serving.engines.vllm_engine import VllmEngine

        return isinstance(engine, (VllmEngine, InstantEngine))

    async def layer(self) -> OpenAILayer:
        """The layer (built on the first call; the engine must be started)."""
        if self._layer is not None:
            return self._layer
        async with self._lock:
            if self._layer is None:
                self._layer = await OpenAILayer.build(self._inner_client(), self.args)
        return self._layer

    def _inner_client(self) -> Any:
        from kvmeter.serving.engines.instant import InstantEngine

        engine = self.engine
        if isinstance(engine, InstantEngine):
            from kvmeter.serving.openai_api.instant_client import InstantEngineClient

            return InstantEngineClient(engine, self.args)
        return engine.async_llm

