"""Idempotent retries: sequential and concurrent retries of one Idempotency-Key are billed once."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import pytest
import pytest_asyncio

from kvmeter.bus import StatsBus
from kvmeter.serving.quota import (
    AttemptOutcome,
    HierarchicalQuota,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyManager,
    IdempotencyTicket,
    IdempotencyUnavailable,
    InvalidIdempotencyKey,
    MemoryIdempotencyManager,
    RedisIdempotencyManager,
    StoredResponse,
    redis_client,
)
from kvmeter.serving.quota.money import to_units
from kvmeter.stats import IdempotencyAttempt
from quota_testlib import estimate, free_port, price, tree, used

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100}'
SSE = (b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
       b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\ndata: [DONE]\n\n')
RESPONSE = StoredResponse(200, (("content-type", "text/event-stream"), ("x-request-id", "req-1"),
                                ("x-ratelimit-remaining-requests", "9")), SSE, streamed=True)


def fp(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@pytest.fixture(params=["memory", "redis"])
def idem_kind(request) -> str:
    return request.param


@pytest_asyncio.fixture
async def make_idem(idem_kind, request, clock):
    """Build idempotency managers on the parametrized backend (Redis: real server, fresh prefix)."""
    prefix = f"i{uuid.uuid4().hex[:8]}:"
    clients = []

    def build(**kw) -> IdempotencyManager:
        kw.setdefault("clock", clock)
        if idem_kind == "memory":
            return MemoryIdempotencyManager(**kw)
        server = request.getfixturevalue("redis_server")
        client = redis_client(server.url, timeout_s=2.0)
        clients.append(client)
        return RedisIdempotencyManager(client, key_prefix=prefix, **kw)

    yield build
    for c in clients:
        await c.aclose()


class MiniGateway:
    """The request path the gateway will run (idempotency → quota → engine → reconcile → store)."""

    def __init__(self, gate: HierarchicalQuota, idem: IdempotencyManager) -> None:
        self.gate, self.idem = gate, idem
        self.engine_runs = 0
        self.release: asyncio.Event | None = None

    async def handle(self, secret: str, key: str, body: bytes = BODY) -> IdempotencyTicket:
        pr = self.gate.directory.authenticate(secret)
        ticket = await self.idem.begin(pr.tenant_id, key, fingerprint=fp(body))
        if ticket.outcome is not AttemptOutcome.FIRST:
            return ticket
        res = await self.gate.reserve(pr, estimate("m", 100, 100, attempt=ticket.attempt, principal=pr))
        self.engine_runs += 1  # the work the client is billed for
        if self.release is not None:
            await self.release.wait()
        await self.gate.reconcile(res, used(100, 0, 40))
        await self.idem.complete(ticket, RESPONSE)
        ticket.response = RESPONSE
        return ticket


async def billed(gate: HierarchicalQuota) -> int:
    (units,) = await gate.store.get_values([f"{gate.store.key_prefix}o:{{acme}}:sd:2024-05-17"])
    return units or 0


ONE_BILL = to_units(price("m", "", used(100, 0, 40)))


async def test_sequential_retries_replay_the_first_result_and_are_billed_once(make_gate, make_idem):
    bus = StatsBus()
    attempts: list[IdempotencyAttempt] = []
    bus.subscribe(IdempotencyAttempt, attempts.append)
    gw = MiniGateway(make_gate(tree(org_limits="{spend_per_day: '10'}")), make_idem(bus=bus))
    first = await gw.handle("sk-test-key-one", "retry-me")
    assert (first.outcome, first.attempt) == (AttemptOutcome.FIRST, 1)
    for _ in range(3):
        again = await gw.handle("sk-test-key-one", "retry-me")
        assert (again.outcome, again.attempt, again.replayed) == (AttemptOutcome.REPLAYED, 1, True)
        assert again.response == RESPONSE  # status, headers in order, every SSE byte
    assert gw.engine_runs == 1
    assert await billed(gw.gate) == ONE_BILL
    assert [(a.outcome, a.replayed) for a in attempts] == [("first", False)] + [("replayed", True)] * 3


async def test_concurrent_retries_join_the_running_attempt_and_are_billed_once(make_gate, make_idem):
    idem = make_idem()
    gw = MiniGateway(make_gate(tree(org_limits="{spend_per_day: '10'}")), idem)
    gw.release = asyncio.Event()
    tasks = [asyncio.ensure_future(gw.handle("sk-test-key-one", "burst")) for _ in range(20)]
    for _ in range(200_000):  # until the 19 retries are all waiting on the first attempt
        if idem.waiting == 19 and gw.engine_runs == 1:
            break
        await asyncio.sleep(0)
    assert (idem.waiting, gw.engine_runs) == (19, 1)
    gw.release.set()
    tickets = await asyncio.gather(*tasks)
    outcomes = sorted(t.outcome.value for t in tickets)
    assert outcomes == ["first"] + ["joined"] * 19
    assert all(t.response == RESPONSE and t.attempt == 1 for t in tickets)
    assert gw.engine_runs == 1
    assert await billed(gw.gate) == ONE_BILL


async def test_same_key_with_another_body_is_a_422_conflict(make_idem):
    idem = make_idem()
    t = await idem.begin("acme", "k", fp(BODY))
    await idem.complete(t, RESPONSE)
    with pytest.raises(IdempotencyConflict) as info:
        await idem.begin("acme", "k", fp(b"other body"))
    assert (info.value.status_code, info.value.code) == (422, "idempotency_key_reused")
    assert (await idem.begin("acme", "k", "")).outcome is AttemptOutcome.REPLAYED  # no fingerprint: no check


async def test_keys_are_scoped_by_tenant(make_idem):
    idem = make_idem()
    a = await idem.begin("acme", "same-key")
    b = await idem.begin("other", "same-key")
    assert a.outcome is b.outcome is AttemptOutcome.FIRST


async def test_an_abandoned_attempt_lets_the_next_retry_run_as_attempt_2(make_idem):
    idem = make_idem()
    t1 = await idem.begin("acme", "k")
    await idem.abandon(t1)
    t2 = await idem.begin("acme", "k")
    assert (t2.outcome, t2.attempt) == (AttemptOutcome.FIRST, 2)
    assert await idem.complete(t1, RESPONSE) is False  # the abandoned attempt cannot store a result
    assert await idem.complete(t2, RESPONSE) is True
    t3 = await idem.begin("acme", "k")
    assert (t3.outcome, t3.attempt, t3.response) == (AttemptOutcome.REPLAYED, 2, RESPONSE)


async def test_a_joined_retry_takes_over_when_the_first_attempt_is_abandoned(make_idem):
    idem = make_idem()
    t1 = await idem.begin("acme", "k")
    waiter = asyncio.ensure_future(idem.begin("acme", "k"))
    for _ in range(100_000):
        if idem.waiting == 1:
            break
        await asyncio.sleep(0)
    assert idem.waiting == 1
    await idem.abandon(t1)
    t2 = await waiter
    assert (t2.outcome, t2.attempt) == (AttemptOutcome.FIRST, 2)


async def test_an_expired_lease_is_taken_over(make_idem, clock):
    idem = make_idem(lease_s=10.0)
    t1 = await idem.begin("acme", "k")
    clock.advance(10.5)  # t1's replica died
    t2 = await idem.begin("acme", "k")
    assert (t2.outcome, t2.attempt) == (AttemptOutcome.FIRST, 2)
    assert await idem.complete(t1, RESPONSE) is False
    assert await idem.complete(t2, StoredResponse(200, (), b"second"))
    assert (await idem.begin("acme", "k")).response.body == b"second"


async def test_oversized_bodies_are_stored_without_body(make_idem):
    idem = make_idem(max_body_bytes=10)
    t = await idem.begin("acme", "big")
    await idem.complete(t, RESPONSE)
    r = await idem.begin("acme", "big")
    assert r.outcome is AttemptOutcome.REPLAYED
    assert r.response.body_omitted and r.response.body == b"" and r.response.status_code == 200


@pytest.mark.parametrize("key", ["", "x" * 256, "line\nbreak"])
async def test_invalid_keys_are_400(make_idem, key):
    with pytest.raises(InvalidIdempotencyKey) as info:
        await make_idem().begin("acme", key)
    assert info.value.status_code == 400


async def test_stored_response_validation():
    with pytest.raises(ValueError):
        StoredResponse(42)
    with pytest.raises(TypeError):
        StoredResponse(200, (), "text")  # type: ignore[arg-type]


async def test_memory_results_expire_after_the_window(clock):
    idem = MemoryIdempotencyManager(window_s=60.0, clock=clock)
    t = await idem.begin("acme", "k")
    await idem.complete(t, RESPONSE)
    clock.advance(59)
    assert (await idem.begin("acme", "k")).outcome is AttemptOutcome.REPLAYED
    clock.advance(2)
    fresh = await idem.begin("acme", "k")
    assert (fresh.outcome, fresh.attempt) == (AttemptOutcome.FIRST, 1)


async def test_redis_results_carry_the_window_as_ttl(redis_server, redis_client, clock):
    idem = RedisIdempotencyManager(redis_client, key_prefix="ttl:", window_s=120.0, clock=clock)
    t = await idem.begin("acme", "k")
    await idem.complete(t, RESPONSE)
    keys = [k async for k in redis_client.scan_iter("ttl:idem:acme:*")]
    assert len(keys) == 1
    assert 0 < await redis_client.pttl(keys[0]) <= 120_000


async def test_a_retry_on_another_replica_polls_until_the_first_finishes(redis_server, clock):
    polls: list[float] = []

    async def counting_sleep(s: float) -> None:
        polls.append(s)
        await asyncio.sleep(0)

    a_client, b_client = redis_client(redis_server.url), redis_client(redis_server.url)
    try:
        prefix = f"x{uuid.uuid4().hex[:6]}:"
        a = RedisIdempotencyManager(a_client, key_prefix=prefix, clock=clock)
        b = RedisIdempotencyManager(b_client, key_prefix=prefix, clock=clock, sleep=counting_sleep,
                                    poll_interval_s=0.01)
        t = await a.begin("acme", "cross")
        joined = asyncio.ensure_future(b.begin("acme", "cross"))
        for _ in range(100_000):
            if polls:
                break
            await asyncio.sleep(0)
        assert polls and not joined.done()
        await a.complete(t, RESPONSE)
        got = await joined
        assert (got.outcome, got.response) == (AttemptOutcome.JOINED, RESPONSE)
    finally:
        await a_client.aclose()
        await b_client.aclose()


async def test_unreachable_redis_refuses_with_503():
    client = redis_client(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(IdempotencyUnavailable) as info:
            await RedisIdempotencyManager(client).begin("acme", "k")
        assert info.value.status_code == 503
    finally:
        await client.aclose()



async def test_a_running_attempt_is_renewed_and_a_dead_ones_retry_runs_after_the_lease(redis_server, clock):
    """The lease of a running attempt moves with its process's renewals: another replica's retry
    joins it while it is renewed, and runs as the next attempt once renewals stop (the process
    died) and ``lease_s`` has passed — not after the join timeout. Fails without the renewal:
    the live attempt loses its lease at 3 s and the retry runs it twice."""
    a_client, b_client = redis_client(redis_server.url), redis_client(redis_server.url)

    async def no_wait(s: float) -> None:
        await asyncio.sleep(0)

    try:
        prefix = f"l{uuid.uuid4().hex[:6]}:"
        a = RedisIdempotencyManager(a_client, key_prefix=prefix, clock=clock, lease_s=3.0)
        b = RedisIdempotencyManager(b_client, key_prefix=prefix, clock=clock, lease_s=3.0, sleep=no_wait,
                                    poll_interval_s=0.01, join_timeout_s=0.05)
        first = await a.begin("acme", "long", fingerprint=fp(BODY))
        assert first.outcome is AttemptOutcome.FIRST
        for _ in range(4):  # 8 s of a live attempt, renewed every 2 s (lease_s / 3 would be 1 s)
            clock.advance(2.0)
            assert await a.renew_leases() == 1
            with pytest.raises(IdempotencyInProgress):
                await b.begin("acme", "long", fingerprint=fp(BODY))
        # the process dies: no more renewals; within the lease the retry still waits ...
        clock.advance(2.9)
        with pytest.raises(IdempotencyInProgress):
            await b.begin("acme", "long", fingerprint=fp(BODY))
        # ... past it, the retry runs as attempt 2 and the dead attempt can no longer store a result
        clock.advance(0.2)
        retry = await b.begin("acme", "long", fingerprint=fp(BODY))
        assert (retry.outcome, retry.attempt) == (AttemptOutcome.FIRST, 2)
        assert await a.renew_leases() == 0
        assert not await a.complete(first, RESPONSE)
        assert await b.complete(retry, RESPONSE)
        assert await b.renew_leases() == 0  # a finished attempt is not renewed
    finally:
        await a_client.aclose()
        await b_client.aclose()


async def test_the_redis_backend_gives_its_idempotency_the_quota_lease_and_renews_it(redis_server):
    """``quota_lease_s`` is the lease of the shared idempotency manager's running attempts too,
    and the backend's start() starts their renewal (before: a fixed 600 s lease, never renewed)."""
    from kvmeter.serving.quota.backends import open_quota_backend

    backend = open_quota_backend(redis_server.url, lease_s=4.5)
    try:
        assert backend.idempotency.lease_s == 4.5
        backend.start()
        renewer = backend.idempotency._renewer
        assert renewer is not None and renewer.running and renewer.interval_s == 1.5
    finally:
        await backend.aclose()
    assert not renewer.running
