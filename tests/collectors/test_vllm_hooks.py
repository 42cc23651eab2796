"""The vLLM hooks' frontend half on vLLM's own objects (no engine started; importing vLLM takes
tens of seconds, hence ``slow``): the accounts the scheduler hook sends cross to kvmeter, never to
vLLM's own stat loggers; one account per request; ids mapped back to kvmeter's."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.metrics.loggers import LoggingStatLogger, StatLoggerManager  # noqa: E402
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvmeter.collectors import vllm_hooks  # noqa: E402
from kvmeter.collectors.vllm_hooks import (ACCOUNTS_CONFIG_KEY, ACCOUNTS_STATS_KEY,  # noqa: E402
                                           KvmeterScheduler, account_of, external_request_id,
                                           install_request_accounts, stat_logger_factory)
from kvmeter.stats import EngineRequestStats  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    """The engine configuration vLLM resolves for the served model (nothing is started)."""
    return AsyncEngineArgs(model=str(model_dir), max_model_len=2048).create_engine_config(UsageContext.ENGINE_CONTEXT)


def _account(internal_id: str, **fields) -> dict:
    base = {"id": internal_id, "reason": "abort", "prompt": 512, "computed": 512, "preempted": 0, "cached": 0,
            "generated": 0, "preemptions": 0}
    return {**base, **fields}


def _stats_carrying(*accounts: dict, **connector) -> SchedulerStats:
    stats = SchedulerStats(num_running_reqs=1)
    stats.kv_connector_stats = {**connector, ACCOUNTS_STATS_KEY: list(accounts)}
    return stats


def _finished(request_id: str, reason: FinishReason, prompt: int, generated: int, cached: int = 0):
    return FinishedRequestStats(finish_reason=reason, e2e_latency=1.5, num_prompt_tokens=prompt,
                                num_generation_tokens=generated, max_tokens_param=None, queued_time=0.1,
                                prefill_time=0.4, inference_time=1.2, decode_time=0.8,
                                mean_time_per_output_token=0.05, num_cached_tokens=cached,
                                request_id=request_id)


def _logger(vllm_config):
    seen: list[EngineRequestStats] = []
    return stat_logger_factory(None, seen.append)(vllm_config, 0), seen


def test_internal_ids_map_back_to_kvmeters(monkeypatch):
    assert external_request_id("kvm-3f2a-0123abcd") == "kvm-3f2a"  # vLLM added "-<8 random>"
    assert external_request_id("chatcmpl-x-y-deadbeef") == "chatcmpl-x-y"
    monkeypatch.setattr(vllm_hooks.vllm_envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", True)
    assert external_request_id("kvm-3f2a-0123abcd") == "kvm-3f2a-0123abcd"  # sent unchanged then


def test_vllms_own_loggers_never_see_the_accounts(vllm_config):
    """vLLM's LoggingStatLogger hands a non-empty kv_connector_stats to its KV-connector logging,
    which fails without a connector; kvmeter's logger (registered first) takes the accounts out."""
    with_hooks = StatLoggerManager(vllm_config, custom_stat_loggers=[stat_logger_factory(None, lambda s: None)])
    stats = _stats_carrying(_account("kvm-1-0123abcd"))
    with_hooks.record(stats, None)
    assert stats.kv_connector_stats is None  # what vLLM sends when no connector is configured
    logging_logger = [lg.per_engine_stat_loggers[0] for lg in with_hooks.stat_loggers
                      if isinstance(getattr(lg, "per_engine_stat_loggers", {}).get(0), LoggingStatLogger)]
    assert logging_logger and logging_logger[0].last_scheduler_stats is stats

    # the hazard the order guards against, as it stands in vLLM 0.32 (if vLLM stops failing here,
    # the module docstring of collectors/vllm_hooks.py needs updating, not the code)
    without = StatLoggerManager(vllm_config)
    with pytest.raises((AttributeError, AssertionError)):
        without.record(_stats_carrying(_account("kvm-2-0123abcd")), None)


def test_a_connectors_own_stats_are_left_in_place(vllm_config):
    logger, seen = _logger(vllm_config)
    stats = _stats_carrying(_account("kvm-1-0123abcd"), nixl={"num_successful_transfers": 3})
    logger.record(stats, None)
    assert stats.kv_connector_stats == {"nixl": {"num_successful_transfers": 3}}
    assert [s.request_id for s in seen] == ["kvm-1"]


def test_one_account_per_request(vllm_config):
    logger, seen = _logger(vllm_config)
    # step 1: an abort (scheduler account only), an error (vLLM's finished stats and the
    # scheduler's account, merged), a finish on a stop string (vLLM's finished stats)
    iteration = IterationStats()
    iteration.finished_requests += [_finished("kvm-err", FinishReason.ERROR, prompt=900, generated=3),
                                    _finished("kvm-stop", FinishReason.STOP, prompt=40, generated=9, cached=32)]
    logger.record(_stats_carrying(_account("kvm-gone-0123abcd", prompt=256, computed=256),
                                  _account("kvm-err-89abcdef", reason="error", prompt=900, computed=903,
                                           generated=4)), iteration)
    # step 2: the abort the frontend sent after it saw the stop string
    logger.record(_stats_carrying(_account("kvm-stop-fedcba98", prompt=40, computed=49, generated=10)), None)
    by_id = {s.request_id: s for s in seen}
    assert [s.request_id for s in seen].count("kvm-stop") == 1 and len(seen) == 3

    gone = by_id["kvm-gone"]
    assert (gone.finish_reason, gone.tokens.input_tokens, gone.computed_tokens, gone.phase_times_measured) == \
        ("abort", 256, 256, False)
    err = by_id["kvm-err"]  # the scheduler's counts, vLLM's phase times
    assert (err.finish_reason, err.tokens.input_tokens, err.tokens.output_tokens, err.computed_tokens) == (
        "error", 900, 4, 903)
    assert err.phase_times_measured and err.prefill_s == pytest.approx(0.4)
    stop = by_id["kvm-stop"]  # vLLM's finished stats stand: the stop-string abort is not a second account
    assert (stop.finish_reason, stop.tokens.output_tokens, stop.tokens.cached_input_tokens, stop.computed_tokens) == \
        ("stop", 9, 32, None)


def test_cached_is_part_of_the_input_at_the_boundary(vllm_config):
    logger, seen = _logger(vllm_config)
    iteration = IterationStats()
    iteration.finished_requests.append(_finished("kvm-a", FinishReason.LENGTH, prompt=100, generated=5, cached=128))
    logger.record(_stats_carrying(_account("kvm-b-0123abcd", prompt=0, computed=0, cached=256)), iteration)
    assert {s.request_id: s.tokens.cached_input_tokens for s in seen} == {"kvm-a": 100, "kvm-b": 0}


def _request(n_prompt: int) -> Request:
    return Request(request_id="kvm-r-0123abcd", prompt_token_ids=list(range(n_prompt)),
                   sampling_params=SamplingParams(max_tokens=16), pooling_params=None)


def test_account_of_a_freed_vllm_request():
    waiting = _request(1500)
    waiting.status = RequestStatus.FINISHED_ABORTED
    assert account_of(waiting) == {"id": "kvm-r-0123abcd", "reason": "abort", "prompt": 0, "computed": 0,
                                   "preempted": 0, "cached": 0, "generated": 0, "preemptions": 0}

    cut = _request(1500)  # admitted with 256 cached tokens, one 256-token chunk computed on top
    setattr(cut, vllm_hooks._CACHED_ATTR, 256)
    cut.num_computed_tokens = 512
    cut.status = RequestStatus.FINISHED_ERROR
    assert (account_of(cut)["reason"], account_of(cut)["prompt"], account_of(cut)["cached"]) == ("error", 512, 256)

    preempted = _request(900)  # preempted at 1,000 positions, aborted 256 tokens into the recompute
    setattr(preempted, vllm_hooks._PEAK_ATTR, 1000)
    setattr(preempted, vllm_hooks._PREEMPTED_ATTR, 1000)
    preempted.num_computed_tokens = 256
    preempted.num_preemptions = 1
    preempted.append_output_token_ids(list(range(101)))
    preempted.status = RequestStatus.FINISHED_ABORTED
    acct = account_of(preempted)
    assert (acct["prompt"], acct["computed"], acct["preempted"], acct["generated"], acct["preemptions"]) == \
        (900, 256, 1000, 101, 1)


def test_install_request_accounts(vllm_config):
    import copy

    config = copy.deepcopy(vllm_config)
    name = install_request_accounts(config)
    assert name == config.scheduler_config.scheduler_cls == f"{KvmeterScheduler.__module__}.KvmeterScheduler"
    assert config.scheduler_config.get_scheduler_cls() is KvmeterScheduler  # what the engine core resolves
    assert config.additional_config == {ACCOUNTS_CONFIG_KEY: True}
    assert install_request_accounts(config) == name  # idempotent

    config.scheduler_config.async_scheduling = True
    config.scheduler_config.scheduler_cls = None
    assert install_request_accounts(config).endswith(".KvmeterAsyncScheduler")

    config.scheduler_config.scheduler_cls = "mypkg.MyScheduler"
    with pytest.raises(ValueError, match="mypkg.MyScheduler"):
        install_request_accounts(config)
