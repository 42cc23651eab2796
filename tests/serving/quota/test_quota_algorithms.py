"""GCRA against a reference token bucket, and the memory store against the Redis Lua scripts."""

from __future__ import annotations

import asyncio
import uuid
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmeter.serving.quota import MemoryQuotaStore, RedisQuotaStore
from kvmeter.serving.quota.gcra import gcra_admit, gcra_adjust, gcra_remaining
from kvmeter.serving.quota.headers import format_reset, retry_after_headers
from kvmeter.serving.quota.plan import (
    COUNTER,
    DEADLINE,
    RATE,
    SETTLE_ADJUST,
    SETTLE_KEEP,
    SETTLE_RELEASE,
    SRC_INPUT,
    SRC_REQUEST,
    SRC_ZERO,
    PlanItem,
    period_end_s,
)

# limits whose emission interval 60/L is a multiple of 0.25 s: every time below is exact in binary,
# so the float GCRA and the exact reference must agree on every decision, boundaries included.
EXACT_LIMITS = [1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60, 120, 240]
T0 = 1_715_947_200.0


@settings(max_examples=300, deadline=None)
@given(limit=st.sampled_from(EXACT_LIMITS),
       ops=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 260)), min_size=1, max_size=60))
def test_gcra_equals_a_token_bucket_of_capacity_limit_refilling_limit_per_minute(limit, ops):
    period, interval = 60.0, 60.0 / limit
    tat: float | None = None
    tokens, last = Fraction(limit), Fraction(0)   # the reference: a full bucket at t = 0
    t = Fraction(0)
    for quarter_seconds, amount in ops:
        t += Fraction(quarter_seconds, 4)
        tokens = min(Fraction(limit), tokens + (t - last) * Fraction(limit, 60))
        last = t
        now = T0 + float(t)
        ok, value = gcra_admit(tat, now, amount, interval, period)
        assert ok == (amount <= tokens)
        if ok:
            tat, tokens = value, tokens - amount
            assert gcra_remaining(tat, now, interval, period) == int(tokens)
        elif amount <= limit:
            # Retry-After is exact: at now + value the reference bucket holds enough
            wait = Fraction(value)
            assert tokens + wait * Fraction(limit, 60) == amount


def test_gcra_adjust_returns_and_charges_units_without_overfilling():
    tat = T0 + 30.0  # half of a 60/min bucket used
    assert gcra_adjust(tat, T0, -10, 1.0) == T0 + 20.0
    assert gcra_adjust(tat, T0, -45, 1.0) is None      # would overfill: the bucket is simply full
    assert gcra_adjust(None, T0, 5, 1.0) == T0 + 5.0   # charging a full bucket


def test_header_formats():
    assert [format_reset(s) for s in (0, 0.0201, 1.5, 60, 360, 3723)] == ["0ms", "21ms", "1.5s", "1m0s", "6m0s",
                                                                         "1h2m3s"]
    assert retry_after_headers(2.0001) == {"retry-after": "3", "retry-after-ms": "2001"}
    assert retry_after_headers(None) == {}


def test_period_end_in_utc():
    assert period_end_s(T0, "day") == 12 * 3600            # 2024-05-17 12:00 UTC
    assert period_end_s(1_704_067_199.0, "month") == 1.0   # 2023-12-31 23:59:59 → 2024-01-01


# --- the memory store and the Redis Lua scripts make the same decisions --------------------

ITEMS = [
    PlanItem(RATE, "org", "requests_per_minute", SRC_REQUEST, SETTLE_ADJUST, 7, period_s=60.0,
             interval_s=60.0 / 7),
    PlanItem(RATE, "api_key", "input_tokens_per_minute", SRC_INPUT, SETTLE_ADJUST, 1000, period_s=60.0,
             interval_s=0.06),
    PlanItem(COUNTER, "org", "concurrent_requests", SRC_REQUEST, SETTLE_RELEASE, 3),
    PlanItem(COUNTER, "org", "spend_per_day", SRC_INPUT, SETTLE_ADJUST, 2500, ttl_s=172800, period="day",
             money=True),
    PlanItem(DEADLINE, "agent_run", "runtime_seconds", SRC_ZERO, SETTLE_KEEP, 0, period_s=90.0, ttl_s=86400),
]

op_strategy = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 1200), st.floats(0, 40, allow_nan=False)),
    st.tuples(st.just("settle"), st.integers(-600, 300), st.floats(0, 40, allow_nan=False)),
)


async def _run(store, ops, prefix):
    keys = [f"{prefix}{i}".encode() for i in range(len(ITEMS))]
    now, out, held = T0, [], []
    for kind, amount, dt in ops:
        now += dt
        if kind == "reserve":
            src = (1, amount, 0, 0, 0, 0, 0)
            if any(src[it.source] > it.limit for it in ITEMS if it.kind != DEADLINE):
                continue  # the gate refuses these before the store
            r = await store.reserve(ITEMS, keys, src, now)
            states = [round(float(s), 6) for s in r.states] if r.admitted else []
            value = None if r.value is None else round(float(r.value), 6)
            retry = None if r.retry_after_s is None else round(r.retry_after_s, 6)
            out.append(("reserve", r.admitted, r.index, retry, value, states))
            if r.admitted:
                held.append(amount)
        elif held:
            a = held.pop(0)
            actual = max(0, a + amount)  # the engine used more or less than reserved
            await store.settle(ITEMS, keys, (1, a, 0, 0, 0, 0, 0), (1, actual, 0, 0, 0, 0, 0), now)
            out.append(("settle", a, actual))
    final = []
    for it, v in zip(ITEMS, await store.get_values(keys), strict=True):
        if v is not None and it.kind == RATE and float(v) <= now:
            v = None  # a full bucket: absent and TAT <= now are the same state
        final.append(None if v is None else round(float(v), 6))
    out.append(("final", final))
    return out


@pytest.mark.redis
def test_memory_and_redis_stores_decide_identically(redis_server):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=st.lists(op_strategy, min_size=1, max_size=40))
    def check(ops):
        prefix = f"eq{uuid.uuid4().hex[:8]}:"

        async def both():
            # leases on (their bookkeeping runs) but longer than any jump of the ops' clock: the
            # in-memory store has no leases, and a holder that never renews would lose its holds
            redis_store = RedisQuotaStore.from_url(redis_server.url, timeout_s=2.0, lease_s=1e9)
            try:
                return await _run(MemoryQuotaStore(), ops, prefix), await _run(redis_store, ops, prefix)
            finally:
                await redis_store.aclose()

        mem, red = asyncio.run(both())
        assert mem == red

    check()
