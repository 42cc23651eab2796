"""Agent run budgets over HTTP: the ``x-agent-run-id`` header on model calls, tool calls reported
to ``POST /v1/agent_runs/{run_id}/tool_calls``; exceeding a budget stops the run's next call."""

from __future__ import annotations

import asyncio

from tests.serving.quota_http.conftest import tenants
from tests.serving.quota_http.engines import GatedEngine

CFG = tenants("""
acme:
  workspaces:
    ws:
      projects:
        calls:
          run_budget: {max_model_calls: 2, max_tool_calls: 2}
          api_keys:
            calls: {key: sk-test-calls-0001}
        time:
          run_budget: {max_runtime_s: 30}
          api_keys:
            time: {key: sk-test-time-00001}
        money:
          run_budget: {max_cost: "0.0005"}
          api_keys:
            money: {key: sk-test-money-0001}
        retries:
          run_budget: {max_retries: 1}
          api_keys:
            retries: {key: sk-test-retry-0001, limits: {requests_per_minute: 1}}
        branches:
          run_budget: {max_parallel_branches: 1}
          api_keys:
            branches: {key: sk-test-branch-001}
""")
CALLS, TIME, MONEY, RETRIES, BRANCHES = ("sk-test-calls-0001", "sk-test-time-00001", "sk-test-money-0001",
                                         "sk-test-retry-0001", "sk-test-branch-001")


def run(run_id: str, **more: str) -> dict[str, str]:
    return {"x-agent-run-id": run_id, **more}


def _stopped(resp, dimension: str) -> dict:
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["level"], err["dimension"]) == ("run_budget_exceeded", "agent_run", dimension)
    assert resp.headers["x-kvmeter-quota-dimension"] == dimension
    return err


async def test_max_model_calls_stops_the_next_call_of_that_run_only(serve):
    s = await serve(CFG)
    for _ in range(2):
        assert (await s.complete(CALLS, headers=run("r-1"))).status_code == 200
    err = _stopped(await s.complete(CALLS, headers=run("r-1")), "model_calls")
    assert "model_calls" in err["message"] and "2" in err["message"]
    assert (await s.complete(CALLS, headers=run("r-2"))).status_code == 200  # another run
    assert (await s.complete(CALLS)).status_code == 200  # not a run
    events = s.billed(api_key_id="calls")
    assert sorted(e["agent_run_id"] for e in events) == ["", "r-1", "r-1", "r-2"]


async def test_reported_tool_calls_stop_the_next_model_call(serve):
    s = await serve(CFG)
    auth = {"authorization": "Bearer sk-test-calls-0001"}
    first = await s.client.post("/v1/agent_runs/r-tools/tool_calls", headers=auth)
    assert first.json() == {"agent_run_id": "r-tools", "tool_calls": 1, "max_tool_calls": 2, "exceeded": False}
    second = await s.client.post("/v1/agent_runs/r-tools/tool_calls", headers=auth, json={"count": 1})
    assert second.json()["exceeded"] is False
    assert (await s.complete(CALLS, headers=run("r-tools"))).status_code == 200
    third = await s.client.post("/v1/agent_runs/r-tools/tool_calls", headers=auth, json={"count": 1})
    assert third.status_code == 200 and third.json()["tool_calls"] == 3 and third.json()["exceeded"] is True
    _stopped(await s.complete(CALLS, headers=run("r-tools")), "tool_calls")
    # bad reports are 4xx with a reason; an unknown key is 401
    bad = await s.client.post("/v1/agent_runs/r-tools/tool_calls", headers=auth, json={"count": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "count"
    zero = await s.client.post("/v1/agent_runs/r-tools/tool_calls", headers=auth, json={"count": 0})
    assert zero.status_code == 400 and zero.json()["error"]["dimension"] == "tool_calls"
    anon = await s.client.post("/v1/agent_runs/r-tools/tool_calls", json={"count": 1})
    assert anon.status_code == 401


async def test_max_runtime_counts_from_the_first_call(serve):
    s = await serve(CFG)
    assert (await s.complete(TIME, headers=run("r-time"))).status_code == 200
    s.clock.advance(29)
    assert (await s.complete(TIME, headers=run("r-time"))).status_code == 200
    s.clock.advance(2)
    err = _stopped(await s.complete(TIME, headers=run("r-time")), "runtime_seconds")
    assert "30" in err["message"]


async def test_max_cost_is_reserved_and_reconciled_like_spend(serve):
    s = await serve(CFG)
    assert (await s.complete(MONEY, n_input=100, max_tokens=100, headers=run("r-cost"))).status_code == 200
    err = _stopped(await s.complete(MONEY, n_input=100, max_tokens=100, headers=run("r-cost")), "cost")
    assert "0.0005" in err["message"]
    assert (await s.complete(MONEY, n_input=100, max_tokens=50, headers=run("r-cost"))).status_code == 200


async def test_max_retries_counts_attempts_after_the_first(serve):
    s = await serve(CFG)
    ok = await s.complete(RETRIES, headers=run("r-retry", **{"idempotency-key": "a"}))
    assert ok.status_code == 200
    # attempt 1 of "b" is refused by the key's 1 request/min; its retry is attempt 2 (retry 1 of 1)
    limited = await s.complete(RETRIES, headers=run("r-retry", **{"idempotency-key": "b"}))
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limited"
    s.clock.advance(60)
    assert (await s.complete(RETRIES, headers=run("r-retry", **{"idempotency-key": "b"}))).status_code == 200
    limited = await s.complete(RETRIES, headers=run("r-retry", **{"idempotency-key": "c"}))
    assert limited.json()["error"]["code"] == "rate_limited"
    s.clock.advance(60)
    _stopped(await s.complete(RETRIES, headers=run("r-retry", **{"idempotency-key": "c"})), "retries")
    attempts = s.attempts(idempotency_key="b")
    assert [(a["attempt"], a["status"]) for a in attempts] == [(1, "rejected"), (2, "admitted")]


async def test_max_parallel_branches_refuses_a_second_call_in_flight(serve, tokenizer):
    engine = GatedEngine(tokenizer, "SmolLM2-135M-Instruct", max_model_len=4096)
    s = await serve(CFG, engine=engine)
    first = asyncio.create_task(s.complete(BRANCHES, headers=run("r-par")))
    await engine.wait_in_flight(1)
    err = _stopped(await s.complete(BRANCHES, headers=run("r-par")), "parallel_branches")
    assert "parallel_branches" in err["message"]
    other_run = asyncio.create_task(s.complete(BRANCHES, headers=run("r-other")))
    await engine.wait_in_flight(2)  # another run of the same key is not held back
    engine.gate.set()
    assert (await first).status_code == 200 and (await other_run).status_code == 200
    assert (await s.complete(BRANCHES, headers=run("r-par"))).status_code == 200  # branch released
