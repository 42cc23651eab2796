"""Tool-call permits, idempotency, approvals and loop stops — one body on the memory store and on a
real Redis (``store_kind``), through :class:`AgentRuns` and :class:`ApprovalDesk`."""

from __future__ import annotations

import pytest
from tests.serving.agents.conftest import config

from kvmeter.ledger.agent_records import ApprovalRecord, RunStopRecord, ToolCallRecord
from kvmeter.serving.agents import AgentRefusal, ModelCallRefused, arguments_digest
from tests.serving.quota.quota_testlib import estimate
from kvmeter.stats import AgentRunStopped, ApprovalEvent, ToolCallDecided


async def report(kit, who: str, tool: str, args=None, run: str = "run-1", **kw):
    """The decision, or the refusal (an AgentRefusal) as a value."""
    try:
        return await kit.agents.report_tool_call(kit.principal(who), run, tool, args, **kw)
    except AgentRefusal as refusal:
        return refusal


def code(x) -> str:
    return x.code if isinstance(x, AgentRefusal) else x.decision


# -- policy on the report -------------------------------------------------------------------------

async def test_blocked_beats_allowed_and_names_the_rule(make_kit):
    kit = make_kit()
    r = await report(kit, "agent", "shell_ls")  # in research's allow list, blocked at the org
    assert (r.status_code, r.code) == (403, "tool_blocked")
    assert r.body_fields() == {"tool": "shell_ls", "rule": "orgs.acme.tool_policy.block 'shell_*'"}
    assert "shell_ls" in r.message and "orgs.acme.tool_policy.block" in r.message
    r = await report(kit, "agent", "browse")  # not in the narrowest allow list
    assert (r.status_code, r.code) == (403, "tool_not_allowed")
    assert r.body_fields()["rule"] == "orgs.acme.workspaces.research.tool_policy.allow"
    ops = await report(kit, "ops", "browse", run="run-ops")  # the ops workspace sets no allow list
    assert code(ops) == "allowed"
    recs = kit.records_of(ToolCallRecord)
    assert [(r.tool, r.decision, r.status_code) for r in recs[:2]] == [("shell_ls", "blocked", 403),
                                                                        ("browse", "not_allowed", 403)]
    assert recs[0].rule == "orgs.acme.tool_policy.block 'shell_*'"
    # a blocked report counted nothing against the run's budget
    usage = await kit.quota.run_usage(kit.principal("agent"), "run-1")
    assert usage.tool_calls == 0


async def test_read_only_calls_repeat_freely_and_count(make_kit):
    kit = make_kit()
    ids = [await report(kit, "agent", "search_web", {"q": "kv"}) for _ in range(3)]
    assert [code(d) for d in ids] == ["allowed"] * 3
    assert len({d.tool_call_id for d in ids}) == 3
    assert [d.tool_calls for d in ids] == [1, 2, 3]
    # the same idempotency key does not make a read-only call a replay
    keyed = [await report(kit, "agent", "search_web", {"q": "x"}, run="run-2", idempotency_key="k") for _ in range(2)]
    assert [code(d) for d in keyed] == ["allowed", "allowed"] and keyed[0].tool_call_id != keyed[1].tool_call_id


# -- side effects ---------------------------------------------------------------------------------

async def test_a_side_effect_reported_twice_with_one_key_gets_the_first_permit(make_kit):
    kit = make_kit()
    first = await report(kit, "agent", "send_email", {"to": "a@b", "body": "hi"}, idempotency_key="mail-1")
    again = await report(kit, "agent", "send_email", '{"body": "hi", "to": "a@b"}', idempotency_key="mail-1")
    assert (code(first), code(again)) == ("allowed", "replayed")
    assert again.tool_call_id == first.tool_call_id
    # another run with the same key: the key is the tenant's, so it is still the same call
    other_run = await report(kit, "agent", "send_email", {"to": "a@b", "body": "hi"}, run="run-9",
                             idempotency_key="mail-1")
    assert code(other_run) == "replayed" and other_run.tool_call_id == first.tool_call_id
    # the key reused for another call is refused, not replayed
    clash = await report(kit, "agent", "send_email", {"to": "c@d"}, idempotency_key="mail-1")
    assert (clash.status_code, clash.code) == (422, "idempotency_key_reused")
    usage = await kit.quota.run_usage(kit.principal("agent"), "run-1")
    assert usage.tool_calls == 1  # one permit counted
    decisions = [r.decision for r in kit.records_of(ToolCallRecord)]
    assert decisions == ["allowed", "replayed", "replayed", "idempotency_conflict"]


async def test_a_side_effect_without_a_key_is_recognised_within_the_window(make_kit, clock):
    kit = make_kit()
    first = await report(kit, "agent", "send_sms", {"to": "+1"})
    clock.advance(299)
    again = await report(kit, "agent", "send_sms", {"to": "+1"})
    assert code(again) == "replayed" and again.tool_call_id == first.tool_call_id
    other_args = await report(kit, "agent", "send_sms", {"to": "+2"})
    assert code(other_args) == "allowed"
    other_run = await report(kit, "agent", "send_sms", {"to": "+1"}, run="run-2")
    assert code(other_run) == "allowed"
    clock.advance(2)  # 301 s after the first: outside the 300 s window
    late = await report(kit, "agent", "send_sms", {"to": "+1"})
    assert code(late) == "allowed" and late.tool_call_id != first.tool_call_id
    # an unclassified tool gets the org's default class (side_effect): also deduplicated
    a = await report(kit, "agent", "lookup", {"id": 7})
    b = await report(kit, "agent", "lookup", {"id": 7})
    assert (a.risk_class, code(b), b.tool_call_id) == ("side_effect", "replayed", a.tool_call_id)


# -- approvals ------------------------------------------------------------------------------------

async def test_a_high_risk_call_waits_for_an_approver_then_gets_exactly_one_permit(make_kit, clock):
    kit = make_kit()
    args = {"service": "api", "version": "1.2"}
    pending = await report(kit, "agent", "deploy_service", args)
    assert (code(pending), pending.status_code) == ("pending_approval", 202)
    a = pending.approval
    assert (a.run_id, a.api_key_id, a.tool, a.arguments_sha256, a.state) == (
        "run-1", "agent", "deploy_service", arguments_digest(args), "pending")
    assert a.policy_version == kit.directory.snapshot.keys["agent"].tool_policy.version
    assert a.expires_ts == clock.wall() + 600
    # polling by reporting again: the same approval, no new one
    again = await report(kit, "agent", "deploy_service", args)
    assert code(again) == "pending_approval" and again.approval.approval_id == a.approval_id
    # the run's model calls wait too
    with pytest.raises(ModelCallRefused) as exc:
        await kit.agents.on_model_call(kit.principal("agent"), "run-1")
    assert (exc.value.status_code, exc.value.code, exc.value.body_fields()["approval_id"]) == (
        409, "approval_pending", a.approval_id)
    assert exc.value.response_headers()["x-should-retry"] == "false"
    # listed for the approver and the requester, not for another key of the tenant
    listed = await kit.desk.list_pending(kit.principal("ops"))
    assert [x["approval_id"] for x in listed] == [a.approval_id]
    assert [x["approval_id"] for x in await kit.desk.list_pending(kit.principal("agent"))] == [a.approval_id]
    assert await kit.desk.list_pending(kit.principal("other")) == []
    assert await kit.desk.list_pending(kit.principal("rival")) == []
    decided = await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=True, reason="change 42")
    assert (decided["status"], decided["decided_by"]) == ("approved", "ops")
    await kit.agents.on_model_call(kit.principal("agent"), "run-1")  # decided: model calls resume
    permit = await report(kit, "agent", "deploy_service", args)
    assert code(permit) == "allowed" and permit.approval.state == "consumed"
    # the approval gave its one permit: the same call asks for a new approval
    next_one = await report(kit, "agent", "deploy_service", args)
    assert code(next_one) == "pending_approval" and next_one.approval.approval_id != a.approval_id
    used = await report(kit, "agent", "deploy_service", args, approval_id=a.approval_id)
    assert (used.code, used.body_fields()["tool_call_id"]) == ("approval_used", permit.tool_call_id)
    events = [(r.approval_id == a.approval_id, r.event) for r in kit.records_of(ApprovalRecord)]
    assert events == [(True, "requested"), (True, "approved"), (True, "consumed"), (False, "requested")]
    assert [e.event for e in kit.published if isinstance(e, ApprovalEvent)] == ["requested", "approved", "consumed",
                                                                                 "requested"]


async def test_an_approval_cannot_be_reused_for_other_arguments_another_run_or_after_expiry(make_kit, clock):
    kit = make_kit()
    args = {"service": "api"}
    a = (await report(kit, "agent", "deploy_service", args)).approval
    await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=True)
    for kw, field in (({"args": {"service": "db"}}, "arguments"), ({"run": "run-2"}, "agent_run_id")):
        r = await report(kit, "agent", "deploy_service", kw.get("args", args), run=kw.get("run", "run-1"),
                         approval_id=a.approval_id)
        assert (r.status_code, r.code, r.body_fields()["mismatch"]) == (409, "approval_mismatch", field)
    other_key = await report(kit, "other", "deploy_service", args, approval_id=a.approval_id)
    assert other_key.body_fields()["mismatch"] == "api_key"
    # without naming it, other arguments simply ask for their own approval
    own = await report(kit, "agent", "deploy_service", {"service": "db"})
    assert code(own) == "pending_approval" and own.approval.approval_id != a.approval_id
    clock.advance(600)  # at its expiry
    expired = await report(kit, "agent", "deploy_service", args, approval_id=a.approval_id)
    assert (expired.status_code, expired.code) == (409, "approval_expired")
    fresh = await report(kit, "agent", "deploy_service", args)
    assert code(fresh) == "pending_approval" and fresh.approval.approval_id not in (a.approval_id,
                                                                                   own.approval.approval_id)
    with pytest.raises(AgentRefusal) as late:
        await kit.desk.decide(kit.principal("ops"), own.approval.approval_id, approve=True)
    assert late.value.code == "approval_expired"


async def test_a_policy_change_voids_approvals_given_under_the_old_one(make_kit):
    kit = make_kit()
    args = {"service": "api"}
    a = (await report(kit, "agent", "deploy_service", args)).approval
    await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=True)
    kit.directory.reload(config().replace("approval_ttl_s: 600", "approval_ttl_s: 900"))
    r = await report(kit, "agent", "deploy_service", args)
    assert code(r) == "pending_approval" and r.approval.approval_id != a.approval_id
    assert r.approval.policy_version != a.policy_version
    named = await report(kit, "agent", "deploy_service", args, approval_id=a.approval_id)
    assert named.body_fields()["mismatch"] == "policy_version"


async def test_rejection_needs_a_reason_and_answers_until_expiry(make_kit, clock):
    kit = make_kit()
    a = (await report(kit, "agent", "deploy_db", {"x": 1})).approval
    with pytest.raises(AgentRefusal) as no_reason:
        await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=False)
    assert (no_reason.value.status_code, no_reason.value.param) == (400, "reason")
    rejected = await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=False, reason="freeze week")
    assert rejected["status"] == "rejected" and rejected["reason"] == "freeze week"
    r = await report(kit, "agent", "deploy_db", {"x": 1})
    assert (r.status_code, r.code, r.body_fields()) == (403, "approval_rejected",
                                                        {"approval_id": a.approval_id, "reason": "freeze week"})
    with pytest.raises(AgentRefusal) as twice:
        await kit.desk.decide(kit.principal("ops"), a.approval_id, approve=True)
    assert (twice.value.status_code, twice.value.code) == (409, "approval_already_decided")
    clock.advance(600)
    assert code(await report(kit, "agent", "deploy_db", {"x": 1})) == "pending_approval"


async def test_who_may_read_and_decide_an_approval(make_kit):
    kit = make_kit()
    a = (await report(kit, "agent", "deploy_x", {})).approval
    for who, status in (("agent", 403), ("other", 403), ("rival", 404)):
        with pytest.raises(AgentRefusal) as exc:
            await kit.desk.decide(kit.principal(who), a.approval_id, approve=True)
        assert exc.value.status_code == status, who
    assert (await kit.desk.get(kit.principal("agent"), a.approval_id))["status"] == "pending"  # its own
    with pytest.raises(AgentRefusal) as other:
        await kit.desk.get(kit.principal("other"), a.approval_id)
    assert other.value.code == "approval_forbidden"
    with pytest.raises(AgentRefusal) as rival:
        await kit.desk.get(kit.principal("rival"), a.approval_id)
    assert rival.value.code == "approval_not_found"
    admin_list = await kit.desk.list_pending(kit.principal("admin"))
    assert [x["approval_id"] for x in admin_list] == [a.approval_id]
    assert (await kit.desk.decide(kit.principal("admin"), a.approval_id, approve=True))["decided_by"] == "admin"


# -- budget and loops -----------------------------------------------------------------------------

async def test_the_tool_call_budget_refuses_the_call_after_the_last_permit(make_kit):
    kit = make_kit(config(max_tool_calls=2))
    assert [code(await report(kit, "agent", "search_web", {"q": i})) for i in range(2)] == ["allowed"] * 2
    over = await report(kit, "agent", "search_web", {"q": 9})
    assert (over.status_code, over.code, over.body_fields()) == (429, "run_budget_exceeded",
                                                                 {"level": "agent_run", "dimension": "tool_calls"})
    # the quota sees the run over its budget: its next model call is refused
    from kvmeter.serving.quota import QuotaRejected
    with pytest.raises(QuotaRejected) as exc:
        await kit.quota.reserve(kit.principal("agent"),
                                estimate("m", 10, 10, agent_run_id="run-1", principal=kit.principal("agent")))
    assert exc.value.dimension == "tool_calls"


async def test_identical_calls_stop_the_run(make_kit):
    kit = make_kit()  # max_identical_tool_calls: 3
    for _ in range(3):
        assert code(await report(kit, "agent", "search_web", {"q": "same"})) == "allowed"
    stop = await report(kit, "agent", "search_web", {"q": "same"})
    assert (stop.status_code, stop.code, stop.body_fields()["reason"]) == (409, "agent_run_stopped",
                                                                           "identical_tool_calls")
    assert "search_web" in stop.body_fields()["detail"] and "3" in stop.body_fields()["detail"]
    after = await report(kit, "agent", "search_web", {"q": "different"})
    assert code(after) == "agent_run_stopped"  # the whole run is stopped
    with pytest.raises(ModelCallRefused) as exc:
        await kit.agents.on_model_call(kit.principal("agent"), "run-1")
    assert exc.value.body_fields()["reason"] == "identical_tool_calls"
    assert code(await report(kit, "agent", "search_web", {"q": "same"}, run="run-2")) == "allowed"
    stops = kit.records_of(RunStopRecord)
    assert [(s.agent_run_id, s.reason) for s in stops] == [("run-1", "identical_tool_calls")]
    assert [(e.attribution.agent_run_id, e.reason) for e in kit.published if isinstance(e, AgentRunStopped)] == [
        ("run-1", "identical_tool_calls")]
    assert [r.decision for r in kit.records_of(ToolCallRecord)][3:5] == ["loop_stopped", "run_stopped"]


async def test_an_a_b_a_cycle_stops_the_run(make_kit):
    kit = make_kit()  # max_cycle_repeats: 3
    seq = [("search_web", {"q": "a"}), ("search_docs", {"id": 1})]
    got = [code(await report(kit, "agent", *seq[i % 2])) for i in range(5)]  # A B A B A: 3 repeats
    assert got == ["allowed"] * 5
    stop = await report(kit, "agent", *seq[1])  # B: the 4th repeat of the A → B cycle
    assert (stop.code, stop.body_fields()["reason"]) == ("agent_run_stopped", "tool_cycle")
    assert "cycle of 2" in stop.body_fields()["detail"]


async def test_a_longer_cycle_is_found_but_progress_is_not_a_cycle(make_kit):
    kit = make_kit()
    a, b, c = ("search_a", {}), ("search_b", {}), ("search_c", {})
    for call in (a, b, c, a, b, c):  # 3 repeats of a 3-call cycle
        assert code(await report(kit, "agent", *call)) == "allowed"
    assert (await report(kit, "agent", *a)).body_fields()["reason"] == "tool_cycle"
    # distinct calls never trip it
    for i in range(20):
        assert code(await report(kit, "agent", "search_web", {"page": i}, run="run-2")) == "allowed"


async def test_the_same_prompt_without_progress_stops_the_run(make_kit):
    kit = make_kit()  # max_repeated_prompts: 2
    p = kit.principal("agent")
    await kit.agents.on_model_call(p, "run-1", "d1")
    await kit.agents.on_model_call(p, "run-1", "d1")
    await report(kit, "agent", "search_web", {"q": 1})  # progress: a permitted tool call
    await kit.agents.on_model_call(p, "run-1", "d1")
    await kit.agents.on_model_call(p, "run-1", "d1")
    with pytest.raises(ModelCallRefused) as exc:
        await kit.agents.on_model_call(p, "run-1", "d1")
    assert (exc.value.status_code, exc.value.code, exc.value.body_fields()["reason"]) == (
        409, "agent_run_stopped", "repeated_prompt")
    assert [s.reason for s in kit.records_of(RunStopRecord)] == ["repeated_prompt"]
    assert code(await report(kit, "agent", "search_web", {"q": 2})) == "agent_run_stopped"


# -- the gateway hooks ----------------------------------------------------------------------------

async def test_declared_tools_are_refused_naming_the_tool_and_rule(make_kit):
    kit = make_kit()
    p = kit.principal("agent")
    await kit.agents.check_declared_tools(p, "run-1", ["search_web", "deploy_x"])
    with pytest.raises(AgentRefusal) as exc:
        await kit.agents.check_declared_tools(p, "run-1", ["search_web", "shell_rm"])
    assert (exc.value.status_code, exc.value.code, exc.value.param) == (403, "tool_blocked", "tools")
    assert exc.value.body_fields()["tool"] == "shell_rm"
    rec = kit.records_of(ToolCallRecord)[-1]
    assert (rec.source, rec.tool, rec.decision) == ("declared", "shell_rm", "blocked")


async def test_emitted_calls_are_decided_without_a_permit(make_kit):
    kit = make_kit()
    p = kit.principal("agent")
    blocked = await kit.agents.on_emitted_tool_call(p, "run-1", "shell_rm", '{"path": "/"}', call_id="call_1")
    assert (blocked.action, blocked.code) == ("refuse", "tool_blocked") and "shell_*" in blocked.message
    ok = await kit.agents.on_emitted_tool_call(p, "run-1", "search_web", '{"q": 1}')
    assert ok.action == "allow"
    held = await kit.agents.on_emitted_tool_call(p, "run-1", "deploy_api", '{"v": 2}', call_id="call_2")
    assert held.action == "pending_approval" and held.approval_id
    # the client reports the same call: the same approval, then one permit once approved
    rep = await report(kit, "agent", "deploy_api", {"v": 2})
    assert code(rep) == "pending_approval" and rep.approval.approval_id == held.approval_id
    await kit.desk.decide(kit.principal("ops"), held.approval_id, approve=True)
    granted = await kit.agents.on_emitted_tool_call(p, "run-1", "deploy_api", '{"v": 2}')
    assert (granted.action, granted.approval_id) == ("allow", held.approval_id)
    assert code(await report(kit, "agent", "deploy_api", {"v": 2})) == "allowed"
    no_run = await kit.agents.on_emitted_tool_call(p, "", "deploy_api", "{}")
    assert (no_run.action, no_run.code) == ("refuse", "approval_requires_run")
    bad = await kit.agents.on_emitted_tool_call(p, "run-1", "search_web", "{not json")
    assert (bad.action, bad.code) == ("refuse", "invalid_value")
    usage = await kit.quota.run_usage(p, "run-1")
    assert usage.tool_calls == 1  # only the reported permit counted
    emitted = [(r.tool, r.decision) for r in kit.records_of(ToolCallRecord) if r.source == "emitted"]
    assert emitted == [("shell_rm", "blocked"), ("deploy_api", "pending_approval"), ("deploy_api", "approval_refused"),
                       ("search_web", "approval_refused")]
    decided = [(e.source, e.decision) for e in kit.published if isinstance(e, ToolCallDecided)]
    assert ("emitted", "blocked") in decided and ("emitted", "allowed") in decided


async def test_idle_runs_are_forgotten_after_their_ttl(make_kit, clock, store_kind):
    if store_kind != "memory":
        pytest.skip("Redis expires the keys itself (EXPIRE on every write)")
    kit = make_kit()
    p = kit.principal("agent")
    await kit.agents.on_model_call(p, "idle-run")  # no digest, no state: nothing is remembered
    await kit.agents.on_model_call(p, "prompted", "d1")
    assert kit.store.tracked_runs() == {("acme", "prompted")}
    clock.advance(7 * 86_400 + 61)
    await kit.agents.on_model_call(p, "other", "d2")  # a sweep runs
    assert kit.store.tracked_runs() == {("acme", "other")}
