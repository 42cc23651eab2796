"""Admission on every dimension and level; every body runs on the memory store, on real Redis and on a
real Redis Cluster."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from quota_testlib import ACME_K1, P_IN, P_OUT, estimate, price, tree, used
from kvmeter.bus import StatsBus
from kvmeter.ledger.prices import parse_price_list
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected, UsageEstimate
from kvmeter.serving.quota.money import to_units
from kvmeter.serving.quota.plan import tagged_node_id
from kvmeter.serving.tenancy import TenantDirectory
from kvmeter.stats import AdmissionDecision, ReservationDrift
from kvmeter.tokens import TokenCounts


K1, K2, O1 = "sk-test-key-one", "sk-test-key-two", "sk-test-other-one"


def est(p: int = 100, m: int = 100, **kw) -> UsageEstimate:
    return estimate("m", p, m, **kw)


def key_of(gate: HierarchicalQuota, level: str, node: str, code: str) -> str:
    return f"{gate.store.key_prefix}{level}:{tagged_node_id(node)}:{code}"


async def rejected(gate: HierarchicalQuota, secret: str, e: UsageEstimate) -> QuotaRejected:
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(gate.directory.authenticate(secret), e)
    return info.value


async def test_reserve_then_reconcile_moves_every_counter_to_actual(make_gate, clock):
    gate = make_gate(tree(key_limits="{requests_per_minute: 60, input_tokens_per_minute: 6000, "
                                     "output_tokens_per_minute: 6000, concurrent_requests: 4, "
                                     "active_kv_tokens: 10000, spend_per_day: '1.00', spend_per_month: '10.00'}"))
    pr = gate.directory.authenticate(K1)
    node = "acme/ws/proj/k1"
    k = lambda code: key_of(gate, "k", node, code)  # noqa: E731
    res = await gate.reserve(pr, est(300, 200, request_id="r1", principal=pr))
    assert res.reserved == used(input_tokens=300, output_tokens=200)
    assert res.reserved_cost == P_IN * 300 + P_OUT * 200
    now = clock.wall()
    conc, kv, sd, sm = await gate.store.get_values([k("conc"), k("kv"), k("sd:2024-05-17"), k("sm:2024-05")])
    assert (conc, kv) == (1, 500)
    assert sd == sm == 450_000  # 0.00045 in nano-units
    itpm, otpm = await gate.store.get_values([k("itpm"), k("otpm")])
    assert itpm == pytest.approx(now + 300 * 0.01) and otpm == pytest.approx(now + 200 * 0.01)

    await gate.reconcile(res, used(input_tokens=300, cached_input_tokens=100, output_tokens=50))
    conc, kv, sd, sm = await gate.store.get_values([k("conc"), k("kv"), k("sd:2024-05-17"), k("sm:2024-05")])
    assert conc is None and kv is None  # released
    actual_cost = P_IN * 200 + Decimal("0.00000025") * 100 + P_OUT * 50
    assert sd == sm == int(actual_cost / Decimal("1e-9"))
    itpm, otpm = await gate.store.get_values([k("itpm"), k("otpm")])
    assert itpm == pytest.approx(now + 3.0) and otpm == pytest.approx(now + 0.5)


async def test_rate_limit_retry_after_is_the_exact_refill_time(make_gate, clock):
    gate = make_gate(tree(key_limits="{requests_per_minute: 6}"))  # one request per 10 s
    pr = gate.directory.authenticate(K1)
    remaining = []
    for _ in range(6):
        r = await gate.reserve(pr, est(principal=pr))
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-limit-requests"] == "6"
    assert remaining == [5, 4, 3, 2, 1, 0]
    e = await rejected(gate, K1, est())
    assert (e.status_code, e.reason, e.level, e.dimension) == (429, "rate_limited", "api_key", "requests_per_minute")
    assert e.retry_after_s == pytest.approx(10.0)
    assert e.headers["retry-after"] == "10" and e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.advance(7.5)
    e = await rejected(gate, K1, est())
    assert e.retry_after_s == pytest.approx(2.5) and e.headers["retry-after"] == "3"
    clock.advance(2.5)
    r = await gate.reserve(pr, est(principal=pr))
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


async def test_output_reserved_at_max_tokens_and_unused_part_returned(make_gate):
    gate = make_gate(tree(key_limits="{output_tokens_per_minute: 1000}"))
    pr = gate.directory.authenticate(K1)
    first = await gate.reserve(pr, est(m=600, principal=pr))
    e = await rejected(gate, K1, est(m=600))
    assert (e.reason, e.dimension) == ("rate_limited", "output_tokens_per_minute")
    assert e.retry_after_s == pytest.approx(12.0)  # 200 tokens over at 1000/60 s per token
    await gate.reconcile(first, used(input_tokens=100, output_tokens=100))
    second = await gate.reserve(pr, est(m=600, principal=pr))
    assert second.headers["x-ratelimit-remaining-output-tokens"] == "300"


async def test_input_tokens_per_minute_binds_at_org_for_all_keys(make_gate):
    gate = make_gate(tree(org_limits="{input_tokens_per_minute: 1000}"))
    await gate.reserve(gate.directory.authenticate(K1), est(p=600))
    e = await rejected(gate, K2, est(p=600))
    assert (e.level, e.dimension) == ("org", "input_tokens_per_minute")
    await gate.reserve(gate.directory.authenticate(O1), est(p=600))  # another org is unaffected


async def test_concurrency_limit_estimates_retry_after_and_frees_on_reconcile(make_gate):
    gate = make_gate(tree(project_limits="{concurrent_requests: 2}"), default_hold_s=1.0)
    pr = gate.directory.authenticate(K1)
    a = await gate.reserve(pr, est(principal=pr))
    await gate.reserve(gate.directory.authenticate(K2), est())
    e = await rejected(gate, K1, est())
    assert (e.status_code, e.reason, e.level, e.dimension) == (429, "concurrency_limited", "project",
                                                              "concurrent_requests")
    assert e.retry_after_s == pytest.approx(0.5)  # Little's law: 1 s mean hold / 2 held
    await gate.reconcile(a, used(100, 0, 10))
    await gate.reserve(pr, est(principal=pr))


async def test_active_kv_tokens_count_prompt_plus_max_tokens(make_gate):
    gate = make_gate(tree(key_limits="{active_kv_tokens: 1000}"))
    pr = gate.directory.authenticate(K1)
    a = await gate.reserve(pr, est(300, 300, principal=pr))
    e = await rejected(gate, K1, est(300, 200))
    assert (e.reason, e.dimension) == ("kv_budget_exceeded", "active_kv_tokens")
    await gate.reserve(pr, est(200, 200, principal=pr))  # exactly 1000
    await gate.reconcile(a, used(300, 0, 300))
    await gate.reserve(pr, est(300, 300, principal=pr))


async def test_spend_per_day_is_402_with_retry_after_at_utc_midnight(make_gate, clock):
    gate = make_gate(tree(org_limits="{spend_per_day: '0.001'}"))
    pr = gate.directory.authenticate(K1)
    held = [await gate.reserve(pr, est(100, 100, principal=pr)) for _ in range(5)]  # 0.0002 each
    e = await rejected(gate, K2, est(100, 100))
    assert (e.status_code, e.reason, e.level, e.dimension) == (402, "spend_exhausted", "org", "spend_per_day")
    assert e.retry_after_s == pytest.approx(12 * 3600)  # clock is at 12:00 UTC
    assert e.headers["retry-after"] == "43200"
    await gate.reconcile(held[0], used(100, 0, 0))  # actual 0.00005: frees 0.00015
    e = await rejected(gate, K2, est(100, 100))            # 0.00085 + 0.0002 > 0.001
    assert "0.00085 of 0.001" in e.message
    await gate.reconcile(held[1], used(100, 0, 0))
    await gate.reserve(pr, est(100, 100, principal=pr))                  # 0.0008 + 0.0002 = exactly the limit


async def test_context_limit_is_per_sequence_while_every_sequence_is_reserved(make_gate):
    """``max_context_tokens`` limits one sequence (prompt + max_tokens); n = 5 choices of 7000 on a
    31-token prompt fit a 32768 limit, and all 5 × 7000 output tokens are still reserved."""
    gate = make_gate(tree(org_limits="{max_context_tokens: 32768, active_kv_tokens: 100000}"))
    pr = gate.directory.authenticate(K1)
    five = dataclasses.replace(est(31, 5 * 7000, principal=pr),
                               sequence=TokenCounts(input_tokens=31, output_tokens=7000))
    res = await gate.reserve(pr, five)
    assert res.reserved == used(input_tokens=31, output_tokens=35_000)
    (kv,) = await gate.store.get_values([key_of(gate, "o", "acme", "kv")])
    assert kv == 35_031  # the KV budget counts every sequence
    await gate.reconcile(res, used())
    # one sequence over the limit is still refused, and the message names that sequence
    over = dataclasses.replace(est(31, 5 * 32_800, principal=pr),
                               sequence=TokenCounts(input_tokens=31, output_tokens=32_800))
    e = await rejected(gate, K1, over)
    assert (e.status_code, e.reason, e.level) == (400, "context_length_exceeded", "org")
    assert "you requested 32831 tokens (31 in the prompt, 32800 for the completion)" in e.message
    # without a sequence the estimate is one sequence (the old single-choice behaviour)
    e = await rejected(gate, K1, est(31, 35_000))
    assert "35031 tokens" in e.message


async def test_spend_per_month_can_answer_429_when_configured(make_gate):
    gate = make_gate(tree(key_limits="{spend_per_month: '0.0003'}"), spend_status_code=429)
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, est(100, 100, principal=pr))
    e = await rejected(gate, K1, est(100, 100))
    assert (e.status_code, e.reason, e.dimension) == (429, "spend_exhausted", "spend_per_month")
    assert e.retry_after_s == pytest.approx(14.5 * 86400)  # 2024-05-17 12:00 → 2024-06-01 00:00


async def test_prompt_over_context_limit_is_400_and_holds_nothing(make_gate):
    gate = make_gate(tree(project_limits="{max_context_tokens: 1000, concurrent_requests: 1}"))
    e = await rejected(gate, K1, est(900, 200))
    assert (e.status_code, e.reason, e.level, e.dimension) == (400, "context_length_exceeded", "project",
                                                              "max_context_tokens")
    assert "1000" in e.message and "900 in the prompt" in e.message
    e = await rejected(gate, K1, est(1200, 0))
    assert "the prompt has 1200 tokens" in e.message
    assert gate.context_limit(gate.directory.authenticate(K1)) == 1000
    await gate.reserve(gate.directory.authenticate(K1), est(800, 200))  # the concurrency slot was free


async def test_reservation_is_all_or_nothing_across_levels(make_gate, clock):
    gate = make_gate(tree(org_limits="{concurrent_requests: 1}", key_limits="{requests_per_minute: 100}"))
    pr = gate.directory.authenticate(K1)
    await gate.reserve(pr, est(principal=pr))
    for _ in range(3):
        e = await rejected(gate, K1, est())
        assert (e.level, e.dimension) == ("org", "concurrent_requests")
    (rpm,) = await gate.store.get_values([key_of(gate, "k", "acme/ws/proj/k1", "rpm")])
    assert rpm == pytest.approx(clock.wall() + 0.6)  # one request's worth: the rejected ones held nothing


async def test_request_larger_than_a_limit_is_refused_without_retry_after(make_gate):
    gate = make_gate(tree(key_limits="{output_tokens_per_minute: 100}"))
    e = await rejected(gate, K1, est(m=200))
    assert (e.status_code, e.reason, e.dimension, e.retry_after_s) == (400, "request_exceeds_limit",
                                                                      "output_tokens_per_minute", None)
    assert "retry-after" not in e.headers
    await gate.reserve(gate.directory.authenticate(K1), est(m=100))


async def test_zero_actual_usage_releases_everything_including_the_request(make_gate):
    gate = make_gate(tree(key_limits="{requests_per_minute: 1, concurrent_requests: 1, spend_per_day: '0.0002'}"))
    pr = gate.directory.authenticate(K1)
    r = await gate.reserve(pr, est(100, 100, principal=pr))
    await rejected(gate, K1, est(100, 100))
    await gate.reconcile(r, used())
    r2 = await gate.reserve(pr, est(100, 100, principal=pr))
    assert r2.headers["x-ratelimit-remaining-requests"] == "0"


async def test_second_reconcile_of_one_reservation_is_a_no_op(make_gate):
    gate = make_gate(tree(key_limits="{output_tokens_per_minute: 1000, concurrent_requests: 1}"))
    pr = gate.directory.authenticate(K1)
    r = await gate.reserve(pr, est(m=500, principal=pr))
    await gate.reconcile(r, used(100, 0, 0))
    await gate.reconcile(r, used(100, 0, 0))  # must not refund twice
    a = await gate.reserve(pr, est(m=1000, principal=pr))
    assert a.headers["x-ratelimit-remaining-output-tokens"] == "0"
    e = await rejected(gate, K1, est(m=0))
    assert e.dimension == "concurrent_requests"  # the slot of the first was released only once


async def test_global_limit_is_shared_by_every_org(make_gate):
    gate = make_gate(tree(global_limits="{requests_per_minute: 3}"))
    await gate.reserve(gate.directory.authenticate(K1), est())
    await gate.reserve(gate.directory.authenticate(K2), est())
    await gate.reserve(gate.directory.authenticate(O1), est())
    e = await rejected(gate, O1, est())
    assert (e.level, e.dimension) == ("global", "requests_per_minute")


async def test_exact_money_comparison_at_the_top_of_the_range(store):
    """9·10¹⁸ nano-units: doubles could not tell these apart; the stores must."""
    from kvmeter.serving.quota.plan import COUNTER, SETTLE_ADJUST, SRC_COST, PlanItem

    item = PlanItem(COUNTER, "org", "spend_per_day", SRC_COST, SETTLE_ADJUST, 9_000_000_000_000_000_000,
                    money=True)
    key = [(store.key_prefix + "big").encode()]
    assert item.big

    def cost(units: int) -> tuple[int, ...]:
        return (1, 0, 0, 0, units, 0, 0)

    assert (await store.reserve([item], key, cost(8_999_999_999_999_999_999), 0.0)).admitted
    assert (await store.reserve([item], key, cost(1), 0.0)).admitted
    res = await store.reserve([item], key, cost(1), 0.0)
    assert not res.admitted and int(res.value) == 9_000_000_000_000_000_000
    # just below 2**53 the double comparison is still exact
    small = PlanItem(COUNTER, "org", "spend_per_day", SRC_COST, SETTLE_ADJUST, 2**53 - 1, money=True)
    key2 = [(store.key_prefix + "small").encode()]
    assert not small.big
    assert (await store.reserve([small], key2, cost(2**53 - 2), 0.0)).admitted
    assert (await store.reserve([small], key2, cost(1), 0.0)).admitted
    assert not (await store.reserve([small], key2, cost(1), 0.0)).admitted


async def test_signals_name_level_dimension_reason_and_drift(make_gate):
    bus = StatsBus()
    decisions: list[AdmissionDecision] = []
    drift: list[ReservationDrift] = []
    bus.subscribe(AdmissionDecision, decisions.append)
    bus.subscribe(ReservationDrift, drift.append)
    gate = make_gate(tree(key_limits="{requests_per_minute: 1}"), bus=bus)
    pr = gate.directory.authenticate(K1)
    r = await gate.reserve(pr, est(100, 300, principal=pr))
    await rejected(gate, K1, est())
    await gate.reconcile(r, used(100, 0, 40))
    assert [(d.admitted, d.reason, d.level, d.dimension, d.status_code) for d in decisions] == [
        (True, "admitted", "", "", 200), (False, "rate_limited", "api_key", "requests_per_minute", 429)]
    assert decisions[0].attribution is r.handle.attribution  # the request's, by reference
    assert (decisions[0].attribution.tenant_id, decisions[0].attribution.tier) == ("acme", "enterprise")
    assert drift[0].attribution is decisions[0].attribution
    by_dim = {d.dimension: d for d in drift}
    assert (by_dim["output_tokens"].reserved, by_dim["output_tokens"].actual) == (300, 40)
    assert (by_dim["input_tokens"].reserved, by_dim["input_tokens"].actual) == (100, 100)
    assert by_dim["cost"].reserved == price("m", "", used(100, 0, 300))
    assert by_dim["cost"].actual == price("m", "", used(100, 0, 40))
    # a gateway that publishes its own decisions turns the gate's off
    quiet = make_gate(tree(key_limits="{requests_per_minute: 1}"), bus=bus, publish_decisions=False)
    before = len(decisions)
    await quiet.reserve(quiet.directory.authenticate(K2), est())
    assert len(decisions) == before


@pytest.mark.parametrize("tokens,attempt", [((100, 0, 10, 0), 1), (used(10, 0, 10), 0), (used(10, 0, 10), True)])
async def test_malformed_estimates_get_a_clear_400(make_gate, tokens, attempt):
    gate = make_gate(tree())  # (bad counts cannot exist: TokenCounts refuses them when built)
    e = await rejected(gate, K1, UsageEstimate(ACME_K1, tokens, attempt=attempt))  # type: ignore[arg-type]
    assert (e.status_code, e.reason) == (400, "invalid_request")


async def test_unpriced_model_is_400_not_a_crash(make_gate):
    gate = make_gate(tree(org_limits="{spend_per_day: '1'}"))
    e = await rejected(gate, K1, estimate("no-such-model", 10, 10))
    assert (e.status_code, e.reason) == (400, "unpriced_model")
    gate2 = make_gate(tree(org_limits="{spend_per_day: '1'}"), price=lambda *a: 0.5)  # float money
    e = await rejected(gate2, K1, est())
    assert e.reason == "unpriced_model" and "Decimal" in e.message


async def test_bad_reservation_handle_is_logged_not_raised(make_gate):
    from kvmeter.serving.quota import Reservation

    gate = make_gate(tree())
    await gate.reconcile(Reservation(request_id="x", handle="not ours"), used(1, 0, 1))
    assert gate.reconcile_errors == 1


async def test_redis_server_time_mode_uses_redis_clock(redis_server, clock):
    import time

    from kvmeter.serving.quota import RedisQuotaStore

    store = RedisQuotaStore.from_url(redis_server.url, key_prefix="srvtime:", server_time=True)
    try:
        gate = HierarchicalQuota(TenantDirectory(tree(key_limits="{requests_per_minute: 2}")), store,
                                 price=price, clock=clock)
        pr = gate.directory.authenticate(K1)
        await store.client.flushdb()
        before = time.time()
        r = await gate.reserve(pr, est(principal=pr))
        (tat,) = await store.get_values(["srvtime:k:{acme}/ws/proj/k1:rpm"])
        assert before - 1 < tat - 30 < time.time() + 1  # one request = 30 s after Redis's now
        await gate.reserve(pr, est(principal=pr))
        e = await rejected(gate, K1, est())
        assert 0 < e.retry_after_s <= 30
        await gate.reconcile(r, used(1, 0, 1))
    finally:
        await store.aclose()


async def test_spend_uses_the_ledger_price_function_reasoning_tokens_at_their_own_price(make_gate):
    # a model whose reasoning tokens cost more than its plain output: per 1M, input 1.00,
    # cached 0.10, output 2.00, reasoning 8.00
    prices = parse_price_list({"version": "t", "currency": "USD", "models": {
        "think": {"input": "1.00", "cached_input": "0.10", "output": "2.00", "reasoning": "8.00"}}})
    bus = StatsBus()
    drift: list[ReservationDrift] = []
    bus.subscribe(ReservationDrift, drift.append)
    gate = make_gate(tree(org_limits="{spend_per_day: '1.00'}"), price=prices.cost, bus=bus)
    pr = gate.directory.authenticate(K1)
    r = await gate.reserve(pr, estimate("think", 1000, 500, principal=pr))
    # the reservation holds the dearest the output can turn out: all 500 as reasoning
    assert r.reserved_cost == prices.cost("think", "enterprise", TokenCounts(1000, 0, 500, 500)) \
        == Decimal("0.005") > prices.cost("think", "enterprise", TokenCounts(1000, 0, 500, 0))
    actual = TokenCounts(input_tokens=1000, cached_input_tokens=400, output_tokens=300, reasoning_tokens=200)
    await gate.reconcile(r, actual)
    (cost,) = [d for d in drift if d.dimension == "cost"]
    # engine-true counts priced by the same function: reasoning at 8.00, the rest of the output at 2.00
    assert cost.actual == prices.cost("think", "enterprise", actual) == \
        (600 * Decimal("1.00") + 400 * Decimal("0.10") + 100 * Decimal("2.00") + 200 * Decimal("8.00")) / 10**6
    (spent,) = await gate.store.get_values([key_of(gate, "o", "acme", "sd:2024-05-17")])
    assert spent == to_units(cost.actual)
