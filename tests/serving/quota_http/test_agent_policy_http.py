"""Agent-run policy over HTTP, on a real ``kvmeter serve`` (uvicorn on loopback, instant engine,
chDB ledger; memory store and a real Redis): the tool-call report endpoint's permits, refusals,
replays and approvals, the approvals API, model calls of waiting and stopped runs, loop stops with
their metric, the ledger's records and the run rollup in the read API."""

from __future__ import annotations

import asyncio
from decimal import Decimal

from prometheus_client.parser import text_string_to_metric_families

from tests.serving.quota_http.conftest import tenants

CFG = tenants("""
acme:
  tool_policy:
    block: ["shell_*"]
    risk: {"deploy_*": high_risk, "send_*": side_effect, "search_*": read_only}
  approvers: [acme-ops]
  run_budget: {max_tool_calls: 20}
  workspaces:
    ws:
      projects:
        bot:
          api_keys:
            acme-agent: {key: sk-test-agent-0001}
        ops:
          api_keys:
            acme-ops: {key: sk-test-opsop-0001}
globex:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            globex-agent: {key: sk-test-globex-001}
""", extra_top="tiers: {paid_interactive: {loop_stops: {max_identical_tool_calls: 2}}}")
AGENT, OPS, GLOBEX = "sk-test-agent-0001", "sk-test-opsop-0001", "sk-test-globex-001"


def auth(secret: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **more}


async def report(s, run: str, body: dict, secret: str = AGENT, **headers: str):
    return await s.client.post(f"/v1/agent_runs/{run}/tool_calls", headers=auth(secret, **headers), json=body)


async def metric(s, name: str, **labels: str) -> float:
    text = (await s.client.get("/metrics")).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def test_reports_are_permitted_refused_and_replayed(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    blocked = await report(s, "r1", {"tool": "shell_exec", "arguments": '{"cmd": "rm -rf /"}'})
    assert blocked.status_code == 403
    err = blocked.json()["error"]
    assert (err["code"], err["tool"], err["rule"], err["param"]) == (
        "tool_blocked", "shell_exec", "orgs.acme.tool_policy.block 'shell_*'", "tool")
    assert "shell_exec" in err["message"] and "orgs.acme.tool_policy.block" in err["message"]
    ok = await report(s, "r1", {"tool": "search_web", "arguments": {"q": "kv cache"}, "call_id": "call_1"})
    assert ok.status_code == 200
    body = ok.json()
    assert (body["decision"], body["risk_class"], body["replayed"], body["tool_calls"], body["max_tool_calls"]) == (
        "allowed", "read_only", False, 1, 20)
    first = await report(s, "r1", {"tool": "send_email", "arguments": {"to": "a@b"}}, **{"idempotency-key": "m-1"})
    again = await report(s, "r1", {"tool": "send_email", "arguments": '{"to":"a@b"}', "idempotency_key": "m-1"})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json()["decision"] == "replayed" and again.json()["tool_call_id"] == first.json()["tool_call_id"]
    assert again.headers["x-kvmeter-idempotent-replay"] == "true"
    clash = await report(s, "r1", {"tool": "send_email", "arguments": {"to": "c@d"}, "idempotency_key": "m-1"})
    assert (clash.status_code, clash.json()["error"]["code"]) == (422, "idempotency_key_reused")
    # bad input: 400 naming the field, nothing decided
    for bad, param in (({"tool": "bad name"}, "tool"), ({"tool": "search_web", "arguments": "{no"}, "arguments"),
                       ({"tool": "search_web", "count": 2}, "count"), ({"tool": "x", "extra": 1}, "extra")):
        resp = await report(s, "r1", bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (bad, resp.text)
    # the count form still counts without policy
    legacy = await report(s, "r1", {"count": 2})
    assert legacy.json() == {"agent_run_id": "r1", "tool_calls": 4, "max_tool_calls": 20, "exceeded": False}
    rows = s.rows("SELECT tool, decision, status_code, call_id FROM tool_calls FINAL WHERE agent_run_id = 'r1'")
    assert sorted((r["tool"], r["decision"], r["status_code"]) for r in rows) == sorted([  # one clock instant
        ("shell_exec", "blocked", 403), ("search_web", "allowed", 200), ("send_email", "allowed", 200),
        ("send_email", "replayed", 200), ("send_email", "idempotency_conflict", 422)])
    assert [r["call_id"] for r in rows if r["tool"] == "search_web"] == ["call_1"]
    assert await metric(s, "kvmeter_agent_tool_calls_total", source="reported", decision="blocked") == 1


async def test_approval_flow_over_http(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    args = {"service": "checkout", "version": "1.4.2"}
    pending = await report(s, "run-dep", {"tool": "deploy_service", "arguments": args})
    assert pending.status_code == 202
    approval_id = pending.json()["approval_id"]
    assert pending.headers["location"] == f"/v1/approvals/{approval_id}"
    assert pending.json()["approval"]["status"] == "pending"
    # the run's next model call waits, with the approval id; other runs do not
    waiting = await s.complete(AGENT, headers={"x-agent-run-id": "run-dep"})
    assert waiting.status_code == 409 and waiting.headers["x-should-retry"] == "false"
    err = waiting.json()["error"]
    assert (err["code"], err["approval_id"], err["level"]) == ("approval_pending", approval_id, "agent_run")
    assert (await s.complete(AGENT, headers={"x-agent-run-id": "run-other"})).status_code == 200
    # the approvals API: the approver lists and approves; the agent may read but not approve
    listed = await s.client.get("/v1/approvals", headers=auth(OPS))
    assert [a["approval_id"] for a in listed.json()["data"]] == [approval_id]
    self_approve = await s.client.post(f"/v1/approvals/{approval_id}/approve", headers=auth(AGENT), json={})
    assert (self_approve.status_code, self_approve.json()["error"]["code"]) == (403, "approval_forbidden")
    foreign = await s.client.get(f"/v1/approvals/{approval_id}", headers=auth(GLOBEX))
    assert foreign.status_code == 404
    approved = await s.client.post(f"/v1/approvals/{approval_id}/approve", headers=auth(OPS),
                                   json={"reason": "CAB-1234"})
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert (await s.client.get(f"/v1/approvals/{approval_id}", headers=auth(AGENT))).json()["decided_by"] == "acme-ops"
    assert (await s.complete(AGENT, headers={"x-agent-run-id": "run-dep"})).status_code == 200
    # the permit, once; other arguments cannot use this approval
    other = await report(s, "run-dep", {"tool": "deploy_service", "arguments": {**args, "version": "9"},
                                        "approval_id": approval_id})
    assert (other.status_code, other.json()["error"]["mismatch"]) == (409, "arguments")
    permit = await report(s, "run-dep", {"tool": "deploy_service", "arguments": args, "approval_id": approval_id})
    assert permit.status_code == 200 and permit.json()["decision"] == "allowed"
    used = await report(s, "run-dep", {"tool": "deploy_service", "arguments": args, "approval_id": approval_id})
    assert (used.status_code, used.json()["error"]["code"]) == (409, "approval_used")
    # a rejection with its reason
    second = (await report(s, "run-dep", {"tool": "deploy_db", "arguments": {}})).json()["approval_id"]
    no_reason = await s.client.post(f"/v1/approvals/{second}/reject", headers=auth(OPS), json={})
    assert (no_reason.status_code, no_reason.json()["error"]["param"]) == (400, "reason")
    rejected = await s.client.post(f"/v1/approvals/{second}/reject", headers=auth(OPS), json={"reason": "freeze"})
    assert rejected.json()["status"] == "rejected"
    refused = await report(s, "run-dep", {"tool": "deploy_db", "arguments": {}})
    assert (refused.status_code, refused.json()["error"]["reason"]) == (403, "freeze")
    events = s.rows("SELECT approval_id, event, actor_key_id, reason FROM approval_events FINAL")
    assert sorted((e["approval_id"] == approval_id, e["event"], e["actor_key_id"], e["reason"]) for e in events) == [
        (False, "rejected", "acme-ops", "freeze"), (False, "requested", "", ""),
        (True, "approved", "acme-ops", "CAB-1234"), (True, "consumed", "", ""), (True, "requested", "", "")]
    attempts = s.attempts(agent_run_id="run-dep")
    assert sorted((a["status"], a["reason"], a["status_code"]) for a in attempts) == [
        ("admitted", "admitted", 200), ("rejected", "approval_pending", 409)]
    assert await metric(s, "kvmeter_agent_approval_events_total", event="approved") == 1


async def test_a_loop_stops_the_run_with_a_metric_and_a_ledger_record(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    for _ in range(2):
        assert (await report(s, "loop", {"tool": "search_web", "arguments": {"q": "same"}})).status_code == 200
    stop = await report(s, "loop", {"tool": "search_web", "arguments": {"q": "same"}})
    assert stop.status_code == 409 and stop.headers["x-should-retry"] == "false"
    err = stop.json()["error"]
    assert (err["code"], err["reason"]) == ("agent_run_stopped", "identical_tool_calls")
    model_call = await s.complete(AGENT, headers={"x-agent-run-id": "loop"})
    assert model_call.status_code == 409 and model_call.json()["error"]["reason"] == "identical_tool_calls"
    assert await metric(s, "kvmeter_agent_stopped_runs_total", reason="identical_tool_calls", tenant="acme") == 1
    stops = s.rows("SELECT agent_run_id, reason, detail FROM agent_run_stops FINAL")
    assert [(r["agent_run_id"], r["reason"]) for r in stops] == [("loop", "identical_tool_calls")]
    assert "search_web" in stops[0]["detail"]


async def test_the_run_rollup_in_the_read_api_is_scoped_to_the_tenant(serve):
    s = await serve(CFG)
    for _ in range(2):
        assert (await s.complete(AGENT, n_input=50, max_tokens=5, headers={"x-agent-run-id": "big"})).status_code == 200
    assert (await s.complete(AGENT, headers={"x-agent-run-id": "small"})).status_code == 200
    assert (await s.complete(GLOBEX, headers={"x-agent-run-id": "theirs"})).status_code == 200
    await report(s, "big", {"tool": "search_web", "arguments": {"q": 1}})
    await report(s, "big", {"tool": "shell_rm"})
    await report(s, "big", {"tool": "deploy_x"})
    assert s.ledger.flush(30)
    s.ledger.refresh_rollups()
    period = "2024-05"
    mine = await s.client.get("/v1/usage/agent_runs", params={"period": period}, headers=auth(AGENT))
    assert mine.status_code == 200, mine.text
    runs = mine.json()
    assert [r["agent_run_id"] for r in runs] == ["big", "small"]  # most expensive first
    big = runs[0]
    assert (big["model_calls"], big["input_tokens"], big["tool_calls"], big["tool_calls_by_tool"],
            big["refused_tool_calls"], big["approvals_requested"]) == (2, 100, 1, {"search_web": 1}, 1, 1)
    # exact money: 100 input × 1.00 + 10 output × 2.00 per 1M tokens, as a decimal string
    assert big["currency"] == "USD" and Decimal(big["subtotal"]) == Decimal("0.00012")
    theirs = await s.client.get("/v1/usage/agent_runs", params={"period": period, "tenant_id": "acme"},
                                headers=auth(GLOBEX))
    assert theirs.status_code == 403
    own = await s.client.get("/v1/usage/agent_runs", params={"period": period}, headers=auth(GLOBEX))
    assert [r["agent_run_id"] for r in own.json()] == ["theirs"]


async def test_one_approval_many_concurrent_reports_over_http_one_permit(serve, quota_store):
    s = await serve(CFG, quota_store=quota_store)
    body = {"tool": "deploy_service", "arguments": {"service": "api"}}
    approval_id = (await report(s, "conc", body)).json()["approval_id"]
    await s.client.post(f"/v1/approvals/{approval_id}/approve", headers=auth(OPS), json={})
    answers = await asyncio.gather(*(report(s, "conc", {**body, "approval_id": approval_id}) for _ in range(30)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] + [409] * 29
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 409} == {"approval_used"}
