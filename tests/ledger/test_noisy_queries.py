"""The ledger's noisy-neighbour read on a real chDB ledger: prompt-cache hit ratio and retries per
logical request per tenant, counted over every attempt's usage row (engine work, not the bill),
with numbers worked out by hand below."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pytest
from ledgerkit import T0, make_event

from kvmeter.ledger.noisy_queries import NoisyQueries


@dataclass(frozen=True)
class _Window:
    start: datetime
    end: datetime
    step_s: int = 60


#: [T0, T0 + 1 h): every event below but the late one (finished at T0 + 2 h)
WINDOW = _Window(datetime.fromtimestamp(T0, timezone.utc), datetime.fromtimestamp(T0 + 3600, timezone.utc))


async def test_hit_ratio_and_retries_per_logical_request_count_every_attempt_once(open_ledger):
    ledger = open_ledger()
    order1 = dict(key="order-1", idempotency_key="order-1")
    events = [
        # acme, logical request order-1 (a key): aborted, failed, then ok — three attempts, three rows,
        # one event id; the cache warms up across the retries
        make_event(1, **order1, request_id="acme-a1", attempt=1, outcome="aborted", finish_reason="abort",
                   undelivered_cause="client_abandoned", undelivered_billing="billed",
                   input_tokens=200, cached_input_tokens=0, output_tokens=3),
        make_event(2, **order1, request_id="acme-a2", attempt=2, outcome="error", finish_reason="error",
                   status_code=500, undelivered_cause="server_failure", undelivered_billing="absorbed",
                   input_tokens=200, cached_input_tokens=128, output_tokens=0),
        make_event(3, **order1, request_id="acme-a3", attempt=3, input_tokens=200, cached_input_tokens=192),
        # acme, order-2 (a key), one attempt; and a request without a key
        make_event(4, key="order-2", idempotency_key="order-2", input_tokens=100, cached_input_tokens=64),
        make_event(5, input_tokens=300, cached_input_tokens=0),
        # acme, finished outside the window
        make_event(7200, input_tokens=5000, cached_input_tokens=0),
        # globex: every input token cached, no key
        make_event(6, "globex", input_tokens=50, cached_input_tokens=50),
        # initech: a request that ended before the engine gave an account (0 input tokens)
        make_event(7, "initech", outcome="aborted", finish_reason="abort", input_tokens=0, output_tokens=0),
    ]
    for e in events:
        await ledger.record(e)
    await ledger.record(events[2])  # a re-sent row of one attempt replaces itself: never doubled
    assert ledger.flush()

    rows = {r["tenant_id"]: r for r in NoisyQueries(ledger.query_client).noisy_neighbours(WINDOW)}
    assert list(rows) == ["acme", "globex", "initech"]
    acme = rows["acme"]
    # input 200 + 200 + 200 + 100 + 300 = 1,000; cached 0 + 128 + 192 + 64 + 0 = 384
    assert (acme["input_tokens"], acme["cached_input_tokens"]) == (1000, 384)
    assert acme["prompt_cache_hit_ratio"] == pytest.approx(0.384)
    # 5 rows of 3 logical requests (2 with a key): 2 retries, 2 / 2 keyed = 1 per logical request
    assert (acme["attempts"], acme["logical_requests"], acme["keyed_logical_requests"]) == (5, 3, 2)
    assert acme["retries"] == 2 and acme["retries_per_logical_request"] == 1.0
    assert acme["tier"] == "paid_interactive"

    globex = rows["globex"]
    assert globex["prompt_cache_hit_ratio"] == 1.0
    assert (globex["attempts"], globex["retries"], globex["keyed_logical_requests"]) == (1, 0, 0)
    assert globex["retries_per_logical_request"] is None  # no keyed request: nothing could be retried
    assert rows["initech"]["prompt_cache_hit_ratio"] is None  # no input: no ratio, never NaN

    only = NoisyQueries(ledger.query_client).noisy_neighbours(WINDOW, ["globex"])
    assert [r["tenant_id"] for r in only] == ["globex"]
    with pytest.raises(ValueError):
        NoisyQueries(ledger.query_client).noisy_neighbours(WINDOW, [""])


async def test_model_calls_per_agent_run_per_tenant_over_the_window_and_per_bucket(open_ledger):
    ledger = open_ledger()
    events = [
        # acme, bucket [T0, T0 + 60): run-a 3 calls, run-b 1 call, one call outside any run
        *(make_event(i, agent_run_id="run-a") for i in (10, 20, 30)),
        make_event(15, agent_run_id="run-b"),
        make_event(25),
        # acme, bucket [T0 + 60, T0 + 120): run-a again, 3 calls (one of them retried after an abort:
        # two attempts, two usage rows, two model calls)
        make_event(70, agent_run_id="run-a"),
        make_event(80, key="a-80", idempotency_key="a-80", request_id="acme-a80-1", attempt=1, outcome="aborted",
                   finish_reason="abort", undelivered_cause="client_abandoned", undelivered_billing="billed",
                   agent_run_id="run-a"),
        make_event(81, key="a-80", idempotency_key="a-80", request_id="acme-a80-2", attempt=2, agent_run_id="run-a"),
        # acme, after the window: not counted
        make_event(7200, agent_run_id="run-a"),
        # initech: run-c (same id as nothing of acme's) 2 calls
        make_event(40, "initech", agent_run_id="run-c", tier="free"),
        make_event(41, "initech", agent_run_id="run-c", tier="free"),
        # globex: no agent run
        make_event(50, "globex"),
    ]
    for e in events:
        await ledger.record(e)
    await ledger.record(events[0])  # a re-sent row replaces itself: still 3 calls
    assert ledger.flush()
    q = NoisyQueries(ledger.query_client)

    rows = {r["tenant_id"]: r for r in q.noisy_neighbours(WINDOW)}
    # acme: 3 + 1 + 3 = 7 agent model calls of 2 runs (run-a counted once over both buckets)
    assert (rows["acme"]["agent_model_calls"], rows["acme"]["agent_runs"]) == (7, 2)
    assert rows["acme"]["model_calls_per_agent_run"] == 3.5
    assert (rows["initech"]["agent_model_calls"], rows["initech"]["agent_runs"],
            rows["initech"]["model_calls_per_agent_run"]) == (2, 1, 2.0)
    assert (rows["globex"]["agent_model_calls"], rows["globex"]["agent_runs"]) == (0, 0)
    assert rows["globex"]["model_calls_per_agent_run"] is None  # no run: no ratio, never NaN

    history = [(r["ts"].timestamp() - T0, r["tenant_id"], r["tier"], r["model_calls"], r["agent_runs"],
                r["model_calls_per_agent_run"]) for r in q.agent_calls_per_run(WINDOW)]
    assert history == [
        (0, "acme", "paid_interactive", 4, 2, 2.0),   # run-a 3 + run-b 1
        (0, "initech", "free", 2, 1, 2.0),
        (60, "acme", "paid_interactive", 3, 1, 3.0),  # run-a alone, once more in this bucket
    ]  # globex has no agent run: no row
    assert [r["tenant_id"] for r in q.agent_calls_per_run(WINDOW, ["initech"])] == ["initech"]
    with pytest.raises(ValueError):
        q.agent_calls_per_run(WINDOW, [""])
