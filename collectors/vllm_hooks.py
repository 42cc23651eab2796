"""Engine hooks: vLLM's stat-logger interface turned into kvmeter's plain stats.

vLLM calls every registered ``StatLoggerBase`` once per engine step with its ``SchedulerStats``
(KV cache usage, running/waiting, prefix-cache counters) and ``IterationStats`` (token counts,
TTFT/ITL samples and ``FinishedRequestStats`` of requests that finished this step, each carrying
kvmeter's own ``request_id``). :class:`KvmeterStatLogger` converts those into
:class:`~kvmeter.stats.EngineStepStats` and :class:`~kvmeter.stats.EngineRequestStats` and hands
them to plain callbacks; it never imports an exporter.

Registration (``vllm/v1/engine/async_llm.py``)::

    AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(on_step, on_request)])

Known gap: a request aborted with ``AsyncLLM.abort()`` never appears in ``finished_requests``
(vLLM issue 55634); the engine adapter bills aborts from the outputs the frontend saw.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from vllm.v1.metrics.loggers import StatLoggerBase

from kvmeter.stats import EngineRequestStats, EngineStepStats
from kvmeter.tokens import TokenCounts

__all__ = ["KvmeterStatLogger", "stat_logger_factory", "step_stats_from_vllm", "request_stats_from_vllm"]

log = logging.getLogger(__name__)

StepCallback = Callable[[EngineStepStats], None]
RequestCallback = Callable[[EngineRequestStats], None]


def request_stats_from_vllm(finished: Any, wall_ts: float) -> EngineRequestStats:
    """Convert one vLLM ``FinishedRequestStats`` (``vllm/v1/metrics/stats.py``); vLLM's
    ``num_prompt_tokens`` / ``num_generation_tokens`` become kvmeter's input / output tokens. The
    stats carry no attribution yet: the engine adapter stamps it (vLLM knows only request ids).

    Args:
        finished: the vLLM object (``request_id``, ``finish_reason``, ``num_prompt_tokens``,
            ``num_generation_tokens``, ``num_cached_tokens``, ``queued_time``, ``prefill_time``,
            ``decode_time``, ``inference_time``, ``e2e_latency``, ``mean_time_per_output_token``,
            ``num_preemptions``; times in seconds).
        wall_ts: wall-clock epoch seconds of the step that reported it.
    """
    reason = getattr(finished, "finish_reason", None)
    prompt = int(finished.num_prompt_tokens)
    cached = int(getattr(finished, "num_cached_tokens", 0) or 0)
    return EngineRequestStats(
        request_id=str(finished.request_id),
        finish_reason=str(reason) if reason is not None else "stop",
        tokens=TokenCounts(input_tokens=prompt, cached_input_tokens=min(cached, prompt),
                           output_tokens=int(finished.num_generation_tokens)),
        queued_s=float(finished.queued_time),
        prefill_s=float(finished.prefill_time),
        decode_s=float(finished.decode_time),
        inference_s=float(finished.inference_time),
        e2e_s=float(getattr(finished, "e2e_latency", 0.0) or 0.0),
        mean_tpot_s=float(getattr(finished, "mean_time_per_output_token", 0.0) or 0.0),
        preemptions=int(getattr(finished, "num_preemptions", 0) or 0),
        wall_ts=wall_ts,
    )


def step_stats_from_vllm(scheduler_stats: Any | None, iteration_stats: Any | None, *,
                         engine_idx: int, kv_blocks_total: int, kv_block_size_tokens: int,
                         wall_ts: float) -> EngineStepStats:
    """Convert one step's vLLM ``SchedulerStats`` and/or ``IterationStats`` (either may be None).

    Prefix-cache counters are per-step deltas in vLLM (``PrefixCacheStats.queries``/``hits`` count
    tokens); ``iteration_details`` (when present) gives the scheduled tokens of the step.
    """
    step = EngineStepStats(wall_ts=wall_ts, engine_idx=engine_idx, kv_blocks_total=kv_blocks_total,
                           kv_block_size_tokens=kv_block_size_tokens)
    if scheduler_stats is not None:
        step.kv_watermark_ratio = float(scheduler_stats.kv_cache_usage)
        step.num_running = int(scheduler_stats.num_running_reqs)
        step.num_waiting = int(scheduler_stats.num_waiting_reqs)
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None:
            step.prefix_cache_queries_tokens = int(prefix.queries)
            step.prefix_cache_hits_tokens = int(prefix.hits)
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None:
            step.scheduled_tokens = int(details.num_ctx_tokens + details.num_generation_tokens)
            step.batch_size = int(details.num_ctx_requests + details.num_generation_requests)
    if iteration_stats is not None:
        step.num_preempted = int(iteration_stats.num_preempted_reqs)
        step.input_tokens = int(iteration_stats.num_prompt_tokens)
        step.output_tokens = int(iteration_stats.num_generation_tokens)
        step.ttfts_s = list(iteration_stats.time_to_first_tokens_iter)
        step.itls_s = list(iteration_stats.inter_token_latencies_iter)
        if not step.batch_size:
            step.batch_size = len(iteration_stats.max_num_generation_tokens_iter) or 0
    return step


class KvmeterStatLogger(StatLoggerBase):
    """A vLLM stat logger that forwards plain kvmeter stats to two callbacks.

    vLLM constructs it with ``(vllm_config, engine_index)``; use :func:`stat_logger_factory` to bind
    the callbacks. Callback errors are logged and swallowed: metering must never stop the engine.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0, *,
                 on_step: StepCallback | None = None, on_request: RequestCallback | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        cache = vllm_config.cache_config
        self.kv_blocks_total = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        self.kv_block_size_tokens = int(getattr(cache, "block_size", 0) or 0)
        self.engine_index = engine_index
        self._on_step = on_step
        self._on_request = on_request
        self._wall = wall_clock

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        wall_ts = self._wall()
        try:
            if iteration_stats is not None and self._on_request is not None:
                for finished in iteration_stats.finished_requests:
                    self._on_request(request_stats_from_vllm(finished, wall_ts))
            if self._on_step is not None and (scheduler_stats is not None or iteration_stats is not None):
                self._on_step(step_stats_from_vllm(
                    scheduler_stats, iteration_stats, engine_idx=engine_idx,
                    kv_blocks_total=self.kv_blocks_total,
                    kv_block_size_tokens=self.kv_block_size_tokens, wall_ts=wall_ts))
        except Exception:  # noqa: BLE001 — never break vLLM's output loop
            log.exception("kvmeter stat logger failed")

    def log_engine_initialized(self) -> None:
        log.info("vLLM engine %d initialized: %d KV blocks of %d tokens", self.engine_index,
                 self.kv_blocks_total, self.kv_block_size_tokens)


def stat_logger_factory(on_step: StepCallback | None, on_request: RequestCallback | None,
                        ) -> Callable[[Any, int], KvmeterStatLogger]:
    """A ``StatLoggerFactory`` (``(vllm_config, engine_index) -> StatLoggerBase``) bound to the
    callbacks, for ``AsyncLLM.from_engine_args(..., stat_loggers=[...])``."""

    def factory(vllm_config: Any, engine_index: int = 0) -> KvmeterStatLogger:
        return KvmeterStatLogger(vllm_config, engine_index, on_step=on_step, on_request=on_request)

    return factory
