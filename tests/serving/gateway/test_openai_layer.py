"""vLLM's serving layer in the gateway, without the real engine: the instant engine runs the same
layer (``--engine instant``), so the metering of every shape — ``n`` choices, prompt lists,
streams, reasoning — the engine records, the ``X-Request-Id`` rules and kvmeter's own refusals
are checked here on a real uvicorn server, and the pieces (merging engine records, handing them to
the claimer) by hand.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvmeter.serving.config import load_serve_config
from kvmeter.serving.engines.finished import FinishedStats
from kvmeter.serving.gateway.app import create_app
from kvmeter.serving.engines.finished import merge_stats
from kvmeter.serving.runtime import ServeRuntime
from kvmeter.attribution import UNATTRIBUTED, Attribution
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts
from tests.conftest import free_port, start_uvicorn
from tests.serving.gateway.conftest import MemoryRecorder, auth

MSG = [{"role": "user", "content": "hi"}]


def _stats(rid: str, prompt: int, gen: int, cached: int = 0, **kw) -> EngineRequestStats:
    return EngineRequestStats(request_id=rid, finish_reason="length",
                              tokens=TokenCounts(input_tokens=prompt, output_tokens=gen, cached_input_tokens=cached),
                              **kw)


# -- merging engine records -----------------------------------------------------------------------


def test_n_sequences_count_their_prompt_once_and_every_output():
    merged = merge_stats("kvm-1", [[_stats("kvm-1", 30, 8, cached=16, decode_s=0.5, preemptions=1),
                                    _stats("kvm-1", 30, 5, cached=0, decode_s=0.7, preemptions=2)]])
    assert (merged.request_id, merged.tokens.input_tokens, merged.tokens.output_tokens) == ("kvm-1", 30, 13)
    assert merged.tokens.cached_input_tokens == 0  # never more than every sequence got from the cache
    assert (merged.decode_s, merged.preemptions) == (0.7, 3)


def test_prompts_of_a_prompt_list_add_up_into_the_requests_record():
    merged = merge_stats("kvm-2", [[_stats("kvm-2-0", 4, 6, cached=2)], [_stats("kvm-2-1", 7, 6, cached=3)]])
    assert (merged.request_id, merged.tokens) == (
        "kvm-2", TokenCounts(input_tokens=11, output_tokens=12, cached_input_tokens=5))


def test_one_record_of_the_request_itself_is_kept_as_it_is():
    only = _stats("kvm-3", 9, 2)
    assert merge_stats("kvm-3", [[only]]) is only
    with pytest.raises(ValueError):
        merge_stats("kvm-3", [[only], []])


# -- finished stats: held for the claimer, published otherwise --------------------------------------


async def test_unclaimed_stats_are_published_and_claimed_ones_taken_once_all_arrived():
    published: list[EngineRequestStats] = []
    store = FinishedStats(published.append)
    store.put(_stats("other", 1, 1))
    store.claim("kvm-4")
    taker = asyncio.create_task(store.take("kvm-4", 2, timeout_s=30))
    store.put(_stats("kvm-4", 5, 3))
    await asyncio.sleep(0)
    assert not taker.done()  # one of two sequences reported
    store.put(_stats("kvm-4", 5, 4))
    assert [s.tokens.output_tokens for s in await taker] == [3, 4]
    assert [s.request_id for s in published] == ["other"]
    store.put(_stats("kvm-4", 5, 9))  # the claim ended: a late report is published
    assert [s.request_id for s in published] == ["other", "kvm-4"]


async def test_a_released_claim_publishes_what_arrived_and_what_comes_later():
    published: list[EngineRequestStats] = []
    store = FinishedStats(published.append)
    store.claim("kvm-5")
    store.put(_stats("kvm-5", 5, 1))
    assert published == []
    store.release("kvm-5")  # aborted: the engine's view stays as the engine reported it
    store.put(_stats("kvm-5", 5, 2))
    assert [s.tokens.output_tokens for s in published] == [1, 2]
    assert await store.take("kvm-5", 1, timeout_s=0.01) == []  # nothing claimed any more


async def test_a_claims_attribution_is_stamped_on_every_report_even_after_the_release():
    acme = Attribution("acme", tier="free", api_key_id="k1", model="m", endpoint="chat.completions")
    published: list[EngineRequestStats] = []
    store = FinishedStats(published.append)
    store.claim("kvm-6", acme)
    store.put(_stats("kvm-6", 5, 1))  # the hooks know only ids: the report comes unattributed
    store.release("kvm-6")  # the client left: the abort's account arrives with the next step
    store.put(_stats("kvm-6", 5, 2))
    store.put(_stats("never-claimed", 5, 3))
    assert [s.attribution for s in published] == [acme, acme, UNATTRIBUTED]
    assert (await store.account("kvm-6", timeout_s=0)).attribution is acme


# -- the instant engine's stack ---------------------------------------------------------------------


@pytest.fixture
async def iclient(instant_stack):
    async with httpx.AsyncClient(base_url=instant_stack.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def records(instant_stack):
    """Engine records the gateway publishes (one per request) while the test runs."""
    seen: list[EngineRequestStats] = []
    unsubscribe = instant_stack.runtime.bus.subscribe(EngineRequestStats, seen.append)
    yield seen
    unsubscribe()


def _event(stack, resp: httpx.Response):
    [event] = [e for e in stack.recorder.events if e.request_id == resp.headers["x-kvmeter-request-id"]]
    return event


async def test_n_choices_bill_every_output_once_with_one_engine_record(instant_stack, iclient, records):
    resp = await iclient.post("/v1/chat/completions", headers=auth("acme"),
                              json={"model": instant_stack.model, "messages": MSG, "max_tokens": 5, "n": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    usage = body["usage"]
    assert usage["completion_tokens"] == 15
    event = _event(instant_stack, resp)
    assert (event.tokens.input_tokens, event.tokens.output_tokens, event.token_source) == (
        usage["prompt_tokens"], 15, "engine_hooks")
    assert (event.reserved.input_tokens, event.reserved.output_tokens) == (usage["prompt_tokens"], 15)
    [record] = [r for r in records if r.request_id == event.request_id]
    assert (record.tokens.input_tokens, record.tokens.output_tokens) == (usage["prompt_tokens"], 15)
    assert record.attribution is event.attribution  # the merged record carries the request's attribution
    assert len(records) == 1  # three sequences, one engine record


async def test_a_prompt_list_streamed_is_one_request_billed_as_its_usage_chunk(instant_stack, iclient, records):
    body = {"model": instant_stack.model, "prompt": ["Hello", "The capital of France is"], "max_tokens": 4,
            "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with iclient.stream("POST", "/v1/completions", headers=auth("globex"), json=body) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) async for line in resp.aiter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 16  # 2 prompts × n=2 × 4
    assert sorted({c["index"] for e in events for c in e["choices"]}) == [0, 1, 2, 3]
    event = _event(instant_stack, resp)
    assert (event.tokens.input_tokens, event.tokens.output_tokens, event.stream) == (usage["prompt_tokens"], 16, True)
    [record] = records
    assert (record.request_id, record.tokens.input_tokens, record.tokens.output_tokens) == (
        event.request_id, usage["prompt_tokens"], 16)
    assert record.attribution.tenant_id == "globex" and record.attribution is event.attribution


async def test_clients_reusing_an_x_request_id_get_it_back_and_distinct_requests(instant_stack, iclient, records):
    headers = {**auth("acme"), "x-request-id": "retry-me"}
    body = {"model": instant_stack.model, "messages": MSG, "max_tokens": 3}
    first, second = await asyncio.gather(*(iclient.post("/v1/chat/completions", headers=headers, json=body)
                                           for _ in range(2)))
    for resp in (first, second):
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "retry-me" and resp.json()["id"] == "chatcmpl-retry-me"
    ours = {first.headers["x-kvmeter-request-id"], second.headers["x-kvmeter-request-id"]}
    assert len(ours) == 2 and {r.request_id for r in records} == ours  # engine ids never collide
    assert {_event(instant_stack, r).request_id for r in (first, second)} == ours


async def test_beam_search_is_a_400_naming_it_and_bills_nothing(instant_stack, iclient):
    before = instant_stack.recorder.billed("acme")
    resp = await iclient.post("/v1/chat/completions", headers=auth("acme"),
                              json={"model": instant_stack.model, "messages": MSG, "use_beam_search": True})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["type"], err["code"]) == ("use_beam_search", "BadRequestError", 400)
    assert instant_stack.recorder.billed("acme") == before


async def test_a_tenants_priority_is_the_grants_not_the_bodys(instant_stack, iclient):
    engine = instant_stack.runtime.engine
    seen: list[int] = []
    original = type(engine).generate

    async def generate(self, request):
        seen.append(request.priority)
        async for out in original(self, request):
            yield out

    type(engine).generate = generate
    try:
        resp = await iclient.post("/v1/chat/completions", headers=auth("hobbyist"),  # free tier: priority 3
                                  json={"model": instant_stack.model, "messages": MSG, "max_tokens": 2,
                                        "priority": -1000})
    finally:
        type(engine).generate = original
    assert resp.status_code == 200 and seen == [3]


# -- serving flags: a reasoning parser, X-Request-Id headers off ----------------------------------

THINKING = "<think>Weighing the load: tokens, not requests.</think> Tokens are the unit of load."


@pytest.fixture(scope="module")
async def reasoning_stack(model_dir):
    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine

    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port,
                                      ("openai", "reasoning_parser"): "qwen3",
                                      ("openai", "enable_request_id_headers"): False}, env={})
    tokenizer = HFTokenizer(model_dir)
    engine = InstantEngine(tokenizer, DEFAULT_MODEL_NAME, max_model_len=4096, text=THINKING)
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    recorder = runtime.gateway.recorder = MemoryRecorder()
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = await start_uvicorn(server)
    yield runtime, recorder, f"http://127.0.0.1:{port}", len(tokenizer.encode(THINKING))
    server.should_exit = True
    await task
    runtime.exporter.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_tokens_are_reported_and_stored(reasoning_stack, stream):
    runtime, recorder, url, sentence = reasoning_stack
    body = {"model": runtime.engine.model_name, "messages": MSG, "max_tokens": sentence}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        resp = await c.post("/v1/chat/completions", headers={**auth("acme"), "x-request-id": "think-1"}, json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage = events[-1]["usage"]
        reasoning = "".join(e["choices"][0]["delta"].get("reasoning") or "" for e in events if e["choices"])
        assert all(e["id"] == "chatcmpl-think-1" for e in events)
    else:
        usage = resp.json()["usage"]
        reasoning = resp.json()["choices"][0]["message"]["reasoning"]
        assert resp.json()["id"] == "chatcmpl-think-1"  # built from X-Request-Id, headers off or on
    assert "Weighing the load" in reasoning
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < thought < usage["completion_tokens"] == sentence
    [event] = [e for e in recorder.events if e.request_id == resp.headers["x-kvmeter-request-id"]]
    assert (event.tokens.output_tokens, event.tokens.reasoning_tokens) == (sentence, thought)
    assert "x-request-id" not in resp.headers  # enable_request_id_headers off: none, as vLLM sends none
