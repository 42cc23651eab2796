"""An engine pool in serve (``engine.replicas``): real OpenAI-compatible replicas on loopback
(``scripted_upstream``) behind one gateway, driven with the official ``openai`` SDK. The router's
policies place the requests, a replica that refuses connections is failed over (billed once, by
the replica that answered) and probed back, one that dies mid-stream ends its request with a clear
error billed for what it streamed, and the metrics carry the replica."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvmeter.bus import StatsBus
from kvmeter.serving.config import ServeConfigError, load_serve_config
from kvmeter.serving.engines.pool import EnginePool
from tests.conftest import free_port, start_uvicorn
from tests.serving.quota_http.conftest import MODEL, one_project_tenants, tenants
from tests.serving.quota_http.scripted_upstream import ScriptedUpstream, Whole

KEY = "sk-test-pool-001"
ADMIN = "sk-test-pool-admin"
CFG = one_project_tenants(f"k1: {{key: {KEY}}}", f"ops: {{key: {ADMIN}, admin: true}}")
SYSTEM = [1000 + i for i in range(64)]  # a shared 64-token head: 4 prefix blocks


def answer(n_in: int, n_out: int = 3) -> Whole:
    return Whole({"id": "cmpl-up", "object": "text_completion", "created": 1, "model": MODEL,
                  "choices": [{"index": 0, "text": "ok" * n_out, "finish_reason": "length", "logprobs": None}],
                  "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})


def sdk(s) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=KEY, max_retries=0)


async def replicas(n: int, n_in: int = 84) -> list[ScriptedUpstream]:
    return [await ScriptedUpstream(MODEL, answer=answer(n_in)).start() for _ in range(n)]


async def pool_stack(serve, model_dir, ups: list, routing: str | None = None, clock=None):
    bus = StatsBus()
    kwargs = {"clock": clock} if clock is not None else {}
    pool = EnginePool([u.url for u in ups], model_dir=model_dir, model_name=MODEL, scrape=False, bus=bus,
                      probe_interval_s=3600.0, **kwargs)  # probed when the test says
    s = await serve(CFG, engine=pool, bus=bus, routing=routing)
    return s, pool


def decisions(s, policy: str, outcome: str) -> float:
    return s.runtime.registry.get_sample_value(
        "kvmeter_router_decisions_requests_total", {"model": MODEL, "policy": policy, "outcome": outcome}) or 0.0


@pytest.mark.parametrize("routing, expected", [("prefix_aware", [4, 0, 0]), ("round_robin", [2, 1, 1])])
async def test_the_policy_places_requests_that_share_a_prefix(serve, model_dir, routing, expected):
    ups = await replicas(3)
    try:
        s, pool = await pool_stack(serve, model_dir, ups, routing)
        client = sdk(s)
        for i in range(4):  # one after another: each replica idle when the next one is routed
            done = await client.completions.create(model=MODEL, prompt=SYSTEM + [2000 + i] * 20, max_tokens=3)
            assert done.usage.prompt_tokens == 84
        assert [len(u.bodies) for u in ups] == expected
        if routing == "prefix_aware":  # the first had nothing to follow; the rest followed its head
            assert (decisions(s, routing, "prefix_miss"), decisions(s, routing, "prefix_hit")) == (1, 3)
        reg = s.runtime.registry
        assert [reg.get_sample_value("kvmeter_replica_routed_requests_total", {"model": MODEL, "replica": u.url})
                or 0.0 for u in ups] == expected
        assert [reg.get_sample_value("kvmeter_replica_up", {"model": MODEL, "replica": u.url}) for u in ups] == [1] * 3
        assert len(s.billed(api_key_id="k1")) == 4
        assert [m.id async for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError, match=f"does not exist. Valid aliases: {MODEL}."):
            await client.completions.create(model="other-model", prompt=[1] * 20, max_tokens=3)
    finally:
        for u in ups:
            await u.stop()


async def test_a_replica_down_before_the_first_byte_is_failed_over_billed_once_and_probed_back(serve, model_dir):
    ups = await replicas(2)
    try:
        s, pool = await pool_stack(serve, model_dir, ups)
        await ups[0].stop()  # replica 0 (the router's first choice when both are idle) refuses connections
        client = sdk(s)
        done = await client.completions.create(model=MODEL, prompt=SYSTEM + [7] * 20, max_tokens=3)
        assert done.usage.completion_tokens == 3 and len(ups[1].bodies) == 1
        assert decisions(s, "prefix_aware", "failover") == 1
        reg = s.runtime.registry
        assert reg.get_sample_value("kvmeter_replica_up", {"model": MODEL, "replica": ups[0].url}) == 0
        rows = s.usage_rows(api_key_id="k1")
        assert [(r["outcome"], r["input_tokens"], r["output_tokens"]) for r in rows] == [("ok", 84, 3)]
        # down: the next request goes straight to replica 1, no failover
        await client.completions.create(model=MODEL, prompt=[5] * 84, max_tokens=3)
        assert len(ups[1].bodies) == 2 and decisions(s, "prefix_aware", "failover") == 1
        assert not s.runtime.scheduler.core.engine_gates[0].available
        # a probe of a replica still down keeps it down; once it answers it is back
        assert not await pool.probe(0)
        await ups[0].start()
        await pool.probe_down()
        assert pool.available(0) and s.runtime.scheduler.core.engine_gates[0].available
        assert reg.get_sample_value("kvmeter_replica_up", {"model": MODEL, "replica": ups[0].url}) == 1
        await client.completions.create(model=MODEL, prompt=[9] * 84, max_tokens=3)
        assert len(ups[0].bodies) == 1  # both idle again: replica 0 takes it
        # every replica down: a 503 naming the replica that could not be reached, billed 0
        for u in ups:
            await u.stop()
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model=MODEL, prompt=[11] * 84, max_tokens=3)
        assert refused.value.status_code == 503 and "unreachable" in refused.value.message
        assert [(r["outcome"], r["output_tokens"]) for r in s.usage_rows(api_key_id="k1")
                if r["status_code"] == 503] == [("error", 0)]
    finally:
        for u in ups:
            if u.server.started and not u.server.should_exit:
                await u.stop()


class DyingReplica:
    """A replica that streams two chat chunks and then dies (its connection cut mid-body)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []

    async def start(self) -> "DyingReplica":
        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}),
                            media_type="application/json")

        async def chat(request: Request) -> Response:
            self.bodies.append(orjson.loads(await request.body()))

            async def events():
                for word in ("Paris", " is"):
                    chunk = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                             "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                raise RuntimeError("the replica died")  # uvicorn cuts the connection mid-body

            return StreamingResponse(events(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.task = await start_uvicorn(self.server)
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def test_a_replica_that_dies_mid_stream_ends_the_request_with_a_clear_error_billed_for_what_ran(
        serve, model_dir, tokenizer):
    dying, spare = DyingReplica(), ScriptedUpstream(MODEL)
    await dying.start()
    await spare.start()
    try:
        s, pool = await pool_stack(serve, model_dir, [dying, spare])
        client = sdk(s)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, stream=True)
        got = []
        with pytest.raises(openai.APIError) as broke:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content if chunk.choices else "")
        assert "".join(got) == "Paris is"
        assert f"replica {dying.url}" in broke.value.message and "broke off" in broke.value.message
        assert len(dying.bodies) == 1 and spare.bodies == []  # streamed once: never replayed elsewhere
        (row,) = s.usage_rows(api_key_id="k1")
        assert row["outcome"] == "error" and row["token_source"] == "estimate"
        assert row["output_tokens"] == len(tokenizer.encode("Paris is")) > 0  # the engine work done is billed
        assert not pool.available(0)  # down until it answers a probe
    finally:
        await dying.stop()
        await spare.stop()


async def test_an_operator_drains_a_replica_and_puts_it_back(serve, model_dir):
    ups = await replicas(2)
    try:
        s, pool = await pool_stack(serve, model_dir, ups)
        admin = {"authorization": f"Bearer {ADMIN}"}
        listed = (await s.client.get("/v1/replicas", headers=admin)).json()["data"]
        assert [(r["replica"], r["available"], r["outstanding_requests"]) for r in listed] == \
            [(ups[0].url, True, 0), (ups[1].url, True, 0)]
        # not an admin key: refused, nothing drained
        resp = await s.client.post("/v1/replicas/drain", headers={"authorization": f"Bearer {KEY}"},
                                   json={"replica": ups[0].url})
        assert resp.status_code == 403 and pool.available(0)
        resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": ups[0].url})
        assert resp.status_code == 200 and resp.json()["draining"] and not resp.json()["available"]
        client = sdk(s)
        for i in range(2):  # both idle: replica 0 would take them, but it drains
            await client.completions.create(model=MODEL, prompt=[3 + i] * 84, max_tokens=3)
        assert [len(u.bodies) for u in ups] == [0, 2]
        assert s.runtime.registry.get_sample_value("kvmeter_replica_available",
                                                   {"model": MODEL, "replica": ups[0].url}) == 0
        assert s.runtime.registry.get_sample_value("kvmeter_replica_up", {"model": MODEL, "replica": ups[0].url}) == 1
        resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": 0, "draining": False})
        assert resp.json()["available"]
        await client.completions.create(model=MODEL, prompt=[9] * 84, max_tokens=3)
        assert [len(u.bodies) for u in ups] == [1, 2]
        resp = await s.client.post("/v1/replicas/drain", headers=admin, json={"replica": "http://nowhere"})
        assert resp.status_code == 404 and "no replica" in resp.json()["error"]["message"]
    finally:
        for u in ups:
            await u.stop()


def test_the_pool_config_is_checked():
    cfg = load_serve_config(None, {("engine", "kind"): "remote", ("engine", "replicas"): ["http://a:8000", "http://b"],
                                   ("engine", "routing"): "least_kv"}, env={})
    assert cfg.engine.replicas == ["http://a:8000", "http://b"] and cfg.engine.routing == "least_kv"
    assert load_serve_config(None, {}, env={}).engine.routing == "prefix_aware"
    from kvmeter.serving.runtime import build_engine

    pool = build_engine(cfg, StatsBus())  # nothing reached until it starts
    assert isinstance(pool, EnginePool) and pool.names == ("http://a:8000", "http://b")
    assert [r.metrics_url for r in pool.replicas] == ["http://a:8000/metrics", "http://b/metrics"]
    asyncio.run(pool.shutdown())
    for overrides, message in [
        ({("engine", "replicas"): ["http://a"]}, "needs engine.kind: remote"),
        ({("engine", "kind"): "remote", ("engine", "replicas"): ["http://a"], ("engine", "remote_url"): "http://a"},
         "not both"),
        ({("engine", "kind"): "remote", ("engine", "replicas"): ["http://a", "http://a"]}, "twice"),
        ({("engine", "kind"): "remote", ("engine", "replicas"): ["http://a"], ("engine", "routing"): "random"},
         "engine.routing"),
    ]:
        with pytest.raises(ServeConfigError, match=message):
            load_serve_config(None, overrides, env={})


async def test_a_pool_that_no_replica_answers_does_not_start(model_dir):
    port = free_port()
    pool = EnginePool([f"http://127.0.0.1:{port}"], model_dir=model_dir, model_name=MODEL, scrape=False)
    with pytest.raises(Exception, match="no replica of the engine pool answers"):
        await pool.start()
    await pool.shutdown()
    await asyncio.sleep(0)


async def test_each_replicas_scraped_kv_gates_it_and_a_failed_scrape_takes_it_out(serve, model_dir, clock):
    from tests.serving.quota_http.test_remote_upstream_http import upstream_app, vllm_metrics

    ports: list[set[int]] = [set(), set()]
    pages = [{"page": vllm_metrics(0.95)}, {"page": vllm_metrics(0.30)}]  # replica 0 above kv_watermark_high
    servers, tasks, urls = [], [], []
    for i in range(2):
        port = free_port()
        servers.append(uvicorn.Server(uvicorn.Config(upstream_app(ports[i], pages[i]), host="127.0.0.1", port=port,
                                                     log_level="warning")))
        tasks.append(await start_uvicorn(servers[-1]))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        bus = StatsBus()
        pool = EnginePool(urls, model_dir=model_dir, model_name=MODEL, bus=bus, clock=clock,
                          scrape_interval_s=3600.0)  # scraped at start, then when the test says
        s = await serve(CFG, engine=pool, bus=bus)
        scheduler = s.runtime.scheduler
        assert scheduler.snapshot().engines_kv_watermark == [0.95, 0.30]  # each replica's own gate
        reg = s.runtime.registry

        def routed() -> list[float]:  # (the upstream records client ports: one kept-alive connection each)
            return [reg.get_sample_value("kvmeter_replica_routed_requests_total", {"model": MODEL, "replica": u})
                    or 0.0 for u in urls]

        async def complete(prompt: list[int]) -> None:
            resp = await s.client.post("/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                                       json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert resp.status_code == 200, resp.text

        await complete(SYSTEM)
        assert routed() == [0, 1] and [len(p) for p in ports] == [0, 1]  # replica 0's KV is full: gate closed
        # replica 0's page stops answering: down (no new requests), and its gauge says so
        pages[0]["page"] = None
        assert await pool.replicas[0].scrape() is None
        assert not scheduler.core.engine_gates[0].available
        assert reg.get_sample_value("kvmeter_replica_up", {"model": MODEL, "replica": urls[0]}) == 0
        # back, nearly empty: a new prefix goes to the emptier replica 0, the known one stays on 1
        pages[0]["page"] = vllm_metrics(0.10)
        await pool.replicas[0].scrape()
        assert pool.available(0) and scheduler.snapshot().engines_kv_watermark == [0.10, 0.30]
        assert reg.get_sample_value("kvmeter_engine_kv_watermark_ratio",  # each replica's series: its URL
                                    {"engine": f"{urls[0]}/metrics#0", "model": MODEL}) == 0.10
        await complete(SYSTEM + [1] * 16)
        assert routed() == [0, 2]  # 4 of 5 blocks on 1: the hit outweighs 0.2 less KV
        await complete([5] * 64)
        assert routed() == [1, 2] and [len(p) for p in ports] == [1, 1]
        assert decisions(s, "prefix_aware", "prefix_hit") == 1 and decisions(s, "prefix_aware", "prefix_miss") == 2
    finally:
        for server, task in zip(servers, tasks, strict=True):
            server.should_exit = True
            await task


#: one org per tier, each with one key ``key-<tier>`` (``sk-pool-<tier>``)
TIERS = ("enterprise", "paid_interactive", "batch", "free")
TIERED = tenants("".join(f"""
org-{tier}:
  tier: {tier}
  workspaces: {{w: {{projects: {{p: {{api_keys: {{key-{tier}: {{key: sk-pool-{tier}}}}}}}}}}}}}
""" for tier in TIERS))


def ask(tier: str, **extra) -> dict:
    return {"json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra},
            "headers": {"authorization": f"Bearer sk-pool-{tier}"}}


def chat_answer() -> Whole:
    return Whole({"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": MODEL,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})


def refused_no_replica(s, tier: str) -> list[tuple[int, str]]:
    return [(a["status_code"], a["reason"]) for a in s.attempts(api_key_id=f"key-{tier}")
            if a["status_code"] == 503]


async def test_a_pool_with_every_replica_down_refuses_every_tier_at_once_billed_nothing_and_serves_once_back(
        serve, model_dir):
    """Regression: once every replica was down, a batch request waited forever and the others until
    their tier's deadline (a misleading 429 ``deadline``), while ``--remote-url`` answered 503 at once.
    The clock here never moves, so a request that waits for a deadline would hang the test: each one
    is bounded by ``wait_for``."""
    ups = [await ScriptedUpstream(MODEL, answer=chat_answer()).start() for _ in range(2)]
    try:
        bus = StatsBus()
        pool = EnginePool([u.url for u in ups], model_dir=model_dir, model_name=MODEL, scrape=False, bus=bus,
                          probe_interval_s=3600.0)  # probed when the test says
        s = await serve(TIERED, engine=pool, bus=bus)
        assert (await s.client.post("/v1/chat/completions", **ask("enterprise"))).status_code == 200
        for u in ups:
            await u.stop()
        # the request that finds them unreachable: 503 upstream_error (both tried, both marked down)
        first = await asyncio.wait_for(s.client.post("/v1/chat/completions", **ask("paid_interactive")), 15)
        assert first.status_code == 503 and first.json()["error"]["code"] == "upstream_error"
        assert not pool.available(0) and not pool.available(1)
        for tier in TIERS:  # every tier, batch (no deadline to wait for) included: refused at once
            resp = await asyncio.wait_for(s.client.post("/v1/chat/completions", **ask(tier)), 15)
            assert resp.status_code == 503, (tier, resp.text)
            err = resp.json()["error"]
            assert err["code"] == "no_replica_available"
            assert f"no replica of model {MODEL!r}" in err["message"] and "replicas are down" in err["message"]
            assert refused_no_replica(s, tier)[-1] == (503, "no_replica_available")
        assert s.runtime.scheduler.core.queued_total == 0
        # billed nothing: no usage row for a refusal the scheduler made (as for its 429s)
        rows = s.usage_rows()
        assert [(r["api_key_id"], r["status_code"]) for r in rows] == [("key-enterprise", 200),
                                                                        ("key-paid_interactive", 503)]
        assert [r["api_key_id"] for r in s.billed()] == ["key-enterprise"]
        # one replica answers a probe again: served again, by it
        await ups[1].start()
        await pool.probe_down()
        assert pool.available(1) and not pool.available(0)
        for tier in TIERS:
            resp = await asyncio.wait_for(s.client.post("/v1/chat/completions", **ask(tier)), 15)
            assert resp.status_code == 200, (tier, resp.text)
        assert [len(u.bodies) for u in ups] == [1, len(TIERS)]  # (the first went to replica 0)
    finally:
        for u in ups:
            if u.server.started and not u.server.should_exit:
                await u.stop()


class GatedDyingReplica:
    """A replica whose chat stream sends one chunk, then dies when the test sets :attr:`die`; its
    completions answer whole."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.die = asyncio.Event()
        self.streaming = asyncio.Event()
        self.bodies: list[dict] = []

    async def start(self) -> "GatedDyingReplica":
        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}),
                            media_type="application/json")

        async def chat(request: Request) -> Response:
            self.bodies.append(orjson.loads(await request.body()))

            async def events():
                chunk = {"id": "chatcmpl-g", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                         "choices": [{"index": 0, "delta": {"content": "Paris"}, "finish_reason": None}]}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                self.streaming.set()
                await self.die.wait()
                raise RuntimeError("the replica died")  # uvicorn cuts the connection mid-body

            return StreamingResponse(events(), media_type="text/event-stream")

        async def completions(request: Request) -> Response:
            self.bodies.append(orjson.loads(await request.body()))
            return Response(orjson.dumps(answer(9).body), media_type="application/json")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/completions", completions, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.task = await start_uvicorn(self.server)
        return self

    async def stop(self) -> None:
        self.die.set()
        self.server.should_exit = True
        await self.task


async def test_requests_queued_when_the_last_replica_dies_are_refused_at_once(serve, model_dir):
    """Regression: a request queued behind a full replica kept waiting (batch: forever) after that
    replica, the pool's last, went down."""
    rep = await GatedDyingReplica().start()
    try:
        bus = StatsBus()
        pool = EnginePool([rep.url], model_dir=model_dir, model_name=MODEL, scrape=False, bus=bus,
                          probe_interval_s=3600.0)
        s = await serve(TIERED, engine=pool, bus=bus, scheduler_options={"max_engine_running": 1})
        core = s.runtime.scheduler.core
        running = asyncio.ensure_future(s.client.post("/v1/chat/completions", **ask("enterprise", stream=True)))
        await asyncio.wait_for(rep.streaming.wait(), 15)
        queued = [asyncio.ensure_future(s.client.post("/v1/chat/completions", **ask(tier)))
                  for tier in ("batch", "free")]
        while core.queued_total < 2:  # (the server's state: both wait behind the running one)
            await asyncio.sleep(0.01)
        rep.die.set()  # the running stream breaks: the replica is down, the pool has none left
        for tier, fut in zip(("batch", "free"), queued, strict=True):
            resp = await asyncio.wait_for(fut, 15)
            assert resp.status_code == 503, (tier, resp.text)
            assert resp.json()["error"]["code"] == "no_replica_available"
            assert refused_no_replica(s, tier) == [(503, "no_replica_available")]
            assert s.billed(api_key_id=f"key-{tier}") == []
        broken = await asyncio.wait_for(running, 15)
        assert broken.status_code == 200 and "upstream_error" in broken.text
        assert len(rep.bodies) == 1 and core.queued_total == 0
        # it answers a probe: served again
        await pool.probe_down()
        resp = await s.client.post("/v1/completions", headers={"authorization": "Bearer sk-pool-batch"},
                                   json={"model": MODEL, "prompt": [5] * 9, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
    finally:
        await rep.stop()
