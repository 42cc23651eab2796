"""Interference on a real chDB ledger: per-step engine work written through the ledger's spool
(``record_step_shares`` → ``engine_steps``) and usage rows, read back as who filled the steps a
tenant's missed requests waited through — directly and through the read API on a real uvicorn
server on loopback. Every expected number is worked out by hand below from the step rows of the
test."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx
import pytest
import uvicorn
from ledgerkit import MODEL, T0, make_event
from starlette.applications import Starlette

from kvmeter.ledger.interference import OBJECTIVES, InterferenceQueries, anonymize, interference_sql
from kvmeter.ledger.read_api import read_routes
from kvmeter.net import free_port
from kvmeter.serving.tenancy import AuthError, Principal, constant_time_lookup, hash_api_key
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS
from kvmeter.stats import EngineStepShares, TenantStepShare


@dataclass(frozen=True)
class _Window:
    start: datetime
    end: datetime
    step_s: int = 60


WINDOW = _Window(datetime.fromtimestamp(T0, timezone.utc), datetime.fromtimestamp(T0 + 3600, timezone.utc))
#: The objectives come from the one tier definition (paid_interactive: TTFT 2 s; free: TTFT 5 s, ITL 0.25 s).
SLOS = [(t.name, t.ttft_slo_s, t.itl_slo_s) for t in DEFAULT_TIERS.values()]


def _step(ts: float, *tenants: TenantStepShare, engine_idx: int = 0) -> EngineStepShares:
    return EngineStepShares(wall_ts=T0 + ts, engine_idx=engine_idx, duration_s=0.5, tenants=tenants)


def _t(tenant: str, prefill: int, decode: int, kv: int, *ids: str, tier: str = "paid_interactive") -> TenantStepShare:
    return TenantStepShare(tenant, tier, prefill, decode, kv, max(1, len(ids)), tuple(ids))


# Engine r1/0, steps of 0.5 s, received at T0 + 99.5 … 103.5:
STEPS_R1 = [
    _step(99.5, _t("globex", 500, 0, 500)),                                      # before acme-r1 arrived
    _step(100.5, _t("globex", 1000, 0, 1000), _t("acme", 0, 2, 300),
          _t("initech", 10, 0, 10, "initech-r5", tier="free")),
    _step(101.5, _t("globex", 1000, 0, 2000), _t("initech", 0, 4, 400, tier="free")),
    _step(102.5, _t("acme", 64, 0, 364, "acme-r1"), _t("globex", 0, 1, 2001),    # acme-r1's prefill
          _t("initech", 0, 4, 404, tier="free")),
    _step(103.5, _t("acme", 0, 1, 365)),                                         # after its first token
]
# Another replica's engine at the same time: not the engine acme-r1 waited for.
STEPS_R2 = [_step(101.0, _t("hooli", 5000, 0, 5000, "hooli-r1"))]

EVENTS = [
    # acme (paid_interactive, TTFT objective 2 s): r1 waited 3 s for its first token (missed), r2
    # 0.5 s (met), r3 missed but its engine steps were never recorded
    make_event(100, request_id="acme-r1", ttft_s=3.0, finish_ts=T0 + 104),
    make_event(200, request_id="acme-r2", ttft_s=0.5),
    make_event(300, request_id="acme-r3", ttft_s=2.5),
    # initech (free: TTFT 5 s, ITL 0.25 s): first token after 1 s (met), mean ITL 0.3 s (missed)
    make_event(100, "initech", request_id="initech-r5", tier="free", ttft_s=1.0, itl_mean_s=0.3,
               finish_ts=T0 + 103),
    # batch has no objective: a 100 s TTFT misses nothing
    make_event(400, "batchco", request_id="batchco-r1", tier="batch", ttft_s=100.0),
]


@pytest.fixture
async def ledger(open_ledger):
    ledger = open_ledger()
    for s in STEPS_R1:
        ledger.record_step_shares(s, model=MODEL, replica="r1")
    for s in STEPS_R2:
        ledger.record_step_shares(s, model=MODEL, replica="r2")
    for e in EVENTS:
        await ledger.record(e)
    assert ledger.flush()
    return ledger


def test_step_rows_reach_engine_steps_as_written(ledger):
    rows = ledger.query_client().query(
        "SELECT replica, tenant_id, tier, prefill_tokens, decode_tokens, kv_tokens, requests, "
        "prefill_request_ids, duration_s FROM engine_steps "
        "WHERE ts = fromUnixTimestamp64Micro({t:Int64}, 'UTC') ORDER BY tenant_id",
        parameters={"t": int((T0 + 102.5) * 1e6)}).result_rows
    assert [tuple(r[:8]) for r in rows] == [
        ("r1", "acme", "paid_interactive", 64, 0, 364, 1, ["acme-r1"]),
        ("r1", "globex", "paid_interactive", 0, 1, 2001, 1, []),
        ("r1", "initech", "free", 0, 4, 404, 1, [])]
    assert {r[8] for r in rows} == {0.5}
    # r1: 1 + 3 + 2 + 3 + 1 rows, r2: 1
    assert ledger.query_client().query("SELECT count() FROM engine_steps").result_rows[0][0] == 10 + 1


def test_ttft_interference_shares_recompute_from_the_step_rows(ledger):
    rows = ledger.interference.interference(WINDOW, slos=SLOS)
    # only acme missed a TTFT objective: r1 (attributed: its id is in the 102.5 step) and r3 (no steps)
    assert {r["tenant_id"] for r in rows} == {"acme"}
    assert {(r["missed_requests"], r["attributed_requests"], r["objective"], r["tier"]) for r in rows} == {
        (2, 1, "ttft", "paid_interactive")}
    by = {r["neighbour"]: r for r in rows}
    # acme-r1's window: engine r1/0, steps in [T0 + 100, T0 + 103] = 100.5, 101.5, 102.5 (99.5 is
    # before its arrival, 103.5 after its first token, replica r2's hooli step another engine)
    assert set(by) == {"globex", "acme", "initech"}
    g, a, i = by["globex"], by["acme"], by["initech"]
    assert (g["steps"], g["prefill_tokens"], g["decode_tokens"]) == (3, 1000 + 1000, 1)
    assert g["kv_token_seconds"] == pytest.approx((1000 + 2000 + 2001) * 0.5)  # 2500.5
    assert (a["steps"], a["prefill_tokens"], a["decode_tokens"]) == (2, 64, 2)
    assert a["kv_token_seconds"] == pytest.approx((300 + 364) * 0.5)  # 332
    assert (i["steps"], i["prefill_tokens"], i["decode_tokens"]) == (3, 10, 8)
    assert i["kv_token_seconds"] == pytest.approx((10 + 400 + 404) * 0.5)  # 407
    # totals: prefill 2074, decode 11, KV token-seconds 3239.5
    assert g["prefill_share"] == pytest.approx(2000 / 2074) and g["decode_share"] == pytest.approx(1 / 11)
    assert g["kv_share"] == pytest.approx(2500.5 / 3239.5)
    assert a["prefill_share"] == pytest.approx(64 / 2074) and i["decode_share"] == pytest.approx(8 / 11)
    assert sum(r["kv_share"] for r in rows) == pytest.approx(1.0)
    # ranked by scheduled tokens: globex 2001, acme 66, initech 18
    assert [r["neighbour"] for r in rows] == ["globex", "acme", "initech"]
    assert [r["rank"] for r in rows] == [1, 2, 3] and [r["is_self"] for r in rows] == [False, True, False]


def test_itl_interference_uses_the_window_between_first_and_last_token(ledger):
    rows = ledger.interference.interference(WINDOW, slos=SLOS, objective="itl")
    # initech-r5 (free, mean ITL 0.3 s > 0.25 s): steps in [T0 + 101, T0 + 103] = 101.5 and 102.5
    assert {r["tenant_id"] for r in rows} == {"initech"}
    by = {r["neighbour"]: r for r in rows}
    assert (by["globex"]["prefill_tokens"], by["globex"]["decode_tokens"], by["globex"]["steps"]) == (1000, 1, 2)
    assert (by["initech"]["decode_tokens"], by["acme"]["prefill_tokens"], by["acme"]["steps"]) == (8, 64, 1)
    assert by["globex"]["kv_token_seconds"] == pytest.approx((2000 + 2001) * 0.5)
    assert by["globex"]["decode_share"] == pytest.approx(1 / 9)


def test_a_tenant_filter_and_no_slos(ledger):
    assert ledger.interference.interference(WINDOW, ["globex"], slos=SLOS) == []
    assert ledger.interference.interference(WINDOW, slos=[]) == []  # no tier has an objective
    only_r3 = ledger.interference.interference(
        _Window(datetime.fromtimestamp(T0 + 250, timezone.utc), WINDOW.end), slos=SLOS)
    assert [(r["missed_requests"], r["attributed_requests"], r["neighbour"], r["prefill_share"]) for r in only_r3] == [
        (1, 0, None, None)]
    with pytest.raises(ValueError, match="objective"):
        ledger.interference.interference(WINDOW, slos=SLOS, objective="e2e")


def test_anonymize_keeps_the_readers_own_name_and_numbers_the_others_by_rank(ledger):
    rows = anonymize(ledger.interference.interference(WINDOW, slos=SLOS), "acme")
    assert [r["neighbour"] for r in rows] == ["tenant-1", "acme", "tenant-2"]
    assert rows[0]["prefill_tokens"] == 2000  # the numbers stay


def test_a_bad_step_is_counted_never_raised(open_ledger):
    ledger = open_ledger()
    ledger.record_step_shares(EngineStepShares(wall_ts=1.0, tenants=(_t("acme", 1, 0, 1),)), model=MODEL, replica="r1")
    assert ledger._steps_invalid == 1


# --------------------------------------------------------------------------- the read API, on loopback

KEYS = {
    hash_api_key("sk-acme"): Principal("acme", "paid_interactive", "ws1", "proj1", "acme-key1"),
    hash_api_key("sk-admin"): Principal("ops", "enterprise", "", "", "ops-admin", admin=True),
}


def _authenticate(key: str | None) -> Principal:
    principal = constant_time_lookup(KEYS, key) if key else None
    if principal is None:
        raise AuthError("unknown API key")
    return principal


@pytest.fixture
def server(ledger):
    app = Starlette(routes=read_routes(ledger.queries, _authenticate, interference=ledger.interference,
                                       slos=lambda: SLOS))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:  # readiness wait, not timing logic
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1/usage/interference"
    server.should_exit = True
    thread.join(10)


def _get(url: str, key: str, **params: str) -> httpx.Response:
    return httpx.get(url, params={"period": "2026-11", **params}, headers={"Authorization": f"Bearer {key}"})


def test_read_api_a_tenant_sees_its_shares_with_the_others_anonymized(server):
    rows = _get(server, "sk-acme").json()
    assert [(r["tenant_id"], r["rank"], r["neighbour"], r["is_self"]) for r in rows] == [
        ("acme", 1, "tenant-1", False), ("acme", 2, "acme", True), ("acme", 3, "tenant-2", False)]
    assert rows[0]["prefill_tokens"] == 2000 and rows[0]["prefill_share"] == pytest.approx(2000 / 2074)
    text = _get(server, "sk-acme").text + _get(server, "sk-acme", objective="itl").text
    assert "globex" not in text and "initech" not in text and "hooli" not in text
    # asking for another tenant is refused; the ITL read has no acme request that missed
    assert _get(server, "sk-acme", tenant_id="initech").status_code == 403
    assert _get(server, "sk-acme", objective="itl").json() == []


def test_read_api_an_admin_sees_names_and_every_victim(server):
    rows = _get(server, "sk-admin").json()
    assert [r["neighbour"] for r in rows] == ["globex", "acme", "initech"]
    itl = _get(server, "sk-admin", objective="itl").json()
    assert {r["tenant_id"] for r in itl} == {"initech"} and "globex" in {r["neighbour"] for r in itl}
    assert [r["neighbour"] for r in _get(server, "sk-admin", tenant_id="globex").json()] == []
    bad = _get(server, "sk-admin", objective="e2e")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_parameter"


def test_cluster_rendering_makes_every_in_and_join_over_a_ledger_table_global():
    for objective in OBJECTIVES:
        single, cluster = interference_sql(objective, True), interference_sql(objective, True, cluster=True)
        assert not any("GLOBAL" in q for q in single)
        counts, work = cluster
        # the one ClickHouse refuses plain on a cluster: an IN over Distributed usage_events inside
        # the query whose FROM is the Distributed engine_steps
        assert "rid GLOBAL IN (SELECT request_id FROM victims)" in counts and work.count("rid GLOBAL IN") == 1
        assert "victims AS v GLOBAL INNER JOIN engines AS e" in counts
        assert "request_id GLOBAL IN (SELECT request_id FROM windows)" in counts
        assert "window_seconds AS w GLOBAL INNER JOIN (" in work
        # nothing else changed: removing GLOBAL gives the single-node text back
        assert (counts.replace("GLOBAL ", ""), work.replace("GLOBAL ", "")) == single
        # every IN / JOIN with a subquery on its right is GLOBAL
        for q in cluster:
            assert " IN (SELECT" not in q.replace("GLOBAL IN (SELECT", "") and " INNER JOIN" not in q.replace(
                "GLOBAL INNER JOIN", "")


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("tenants", [None, ["acme", "initech"]])
def test_the_cluster_rendering_runs_on_chdb_and_answers_as_the_single_node_query(ledger, objective, tenants):
    """chDB (local MergeTree tables) accepts GLOBAL IN / GLOBAL JOIN and ignores it: the cluster
    query's rows are the single-node query's. (Not run on a multi-shard cluster: none here.)"""
    cluster = InterferenceQueries(ledger.query_client, cluster=True)
    expected = ledger.interference.interference(WINDOW, tenants, SLOS, objective)
    assert expected  # the fixture has a missed request of each objective
    assert cluster.interference(WINDOW, tenants, SLOS, objective) == expected
    asked: list[int] = []
    lazily = InterferenceQueries(ledger.query_client, cluster=lambda: bool(asked.append(1)) or True)
    assert lazily.interference(WINDOW, tenants, SLOS, objective) == expected and asked == [1]
