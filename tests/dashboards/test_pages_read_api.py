"""Every page under AppTest on a ledger filled by a real replay, read through ``kvmeter serve``'s
read API (mode *a*: the embedded ledger while serve holds it), and the tenant scope."""

from __future__ import annotations

from datetime import datetime

import httpx
import pytest
from apptest import PAGES, assert_clean, chart, charts, dataset_frames, metric_labels, run_page
from dashkit import KEYS, TENANTS

from kvmeter.dashboards.errors import ScopeError, SignInError
from kvmeter.dashboards.http_source import HttpSource
from kvmeter.dashboards.source import ScopedSource
from kvmeter.dashboards.views.noisy import AGENT, CACHE, DECODE, KV, PREFILL, QUEUE, RETRIES, THRASH
from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS
from kvmeter.dashboards.views.common import si
from kvmeter.dashboards.window import Window

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: page → (metric labels that must be there, chart titles (prefixes) that must be drawn with data)
EXPECTED: dict[str, tuple[list[str], list[str]]] = {
    "overview": (["Requests / s (mean)", "Input tokens / s", "Output tokens / s", "Mean active KV (tokens)",
                  "Worst queue wait p95"],
                 ["Requests / s", "Tokens / s", "KV watermark", "Active KV tokens", "Queue wait",
                  "Requests waiting"]),
    "kv": (["Peak KV watermark", "Mean active KV", "Largest KV holder", "Its share of KV held"],
           ["KV watermark", "Engine batch", "Active KV tokens per tenant", "Top KV consumers"]),
    "latency": ([], ["TTFT by tier", "ITL by tier", "TTFT p95 per bucket", "ITL p95 per bucket",
                     "Where a request's time goes"]),
    "tenants": (["Tenants with traffic", "Tenants that queued"],
                ["Service share per tenant", "Jain's index", "Noisy neighbours", "Queue depth per tenant"]),
    "goodput": (["Goodput ratio (tokens)", "Requests inside SLO", "Work abandoned", "Attempts refused"],
                ["Throughput vs goodput by tier", "Goodput ratio by tier", "Goodput ratio per bucket",
                 "Tokens / s: throughput vs goodput", "Refused attempts by reason"]),
    "quota": (["Rejected attempts", "Rejection rate", "Reserved vs used", "Tokens reserved"],
              ["Refusals by tenant and reason", "Tokens reserved at admission", "Reservation drift per tenant",
               "Share of max_tokens"]),
    "noisy": (["Prompt-cache hit ratio", "Retries per logical request", "Tenants thrashing the cache",
               "Tenants retrying"],
              ["Prompt-cache hit ratio per tenant", "Model calls per agent run per tenant",
               "Share of scheduled prefill tokens per tenant",
               "Share of scheduled decode tokens per tenant"]),
    "agent_runs": (["Agent runs", "Loops stopped", "Approvals pending", "Most expensive run", "Tool calls refused"],
                   ["Most expensive runs", "Tool calls permitted by risk class", "Runs stopped by reason"]),
    "billing": (["Invoice total", "Invoice lines", "Tenants reconciled", "Tenants with drift"],
                ["Amount per tenant", "Engine vs ledger tokens", "Requests by reconciliation class"]),
    "gpu": (["GPUs reporting", "Mean utilization (coarse)", "Peak memory used"],
            ["Utilization (coarse", "Device memory used", "Board power", "GPU temperature"]),
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_for_an_admin(page, reader, dashboard_env):
    dashboard_env(server=reader.url, key=KEYS["admin"])
    at = run_page(page)
    assert_clean(at)
    labels, titles = EXPECTED[page]
    assert set(labels) <= set(metric_labels(at)), metric_labels(at)
    for title in titles:
        assert chart(at, title)["rows"] > 0, f"{page}: chart {title!r} has no data"
    assert all(c["title"] for c in charts(at)), "every chart has a title"


def _axis_titles(spec) -> list[str]:
    out = []
    for enc in [spec.get("encoding", {})] + [layer.get("encoding", {}) for layer in spec.get("layer", [])]:
        for channel in ("x", "y"):
            if isinstance(enc.get(channel), dict) and enc[channel].get("title"):
                out.append(enc[channel]["title"])
    return out


def test_time_axes_are_utc_and_value_axes_have_units(reader, dashboard_env, replay):
    dashboard_env(server=reader.url, key=KEYS["admin"])
    at = run_page("overview")
    for c in charts(at):
        titles = _axis_titles(c["spec"])
        assert "time (UTC)" in titles, (c["title"], titles)
        assert any(("/" in t or "(" in t or "tokens" in t or "requests" in t) for t in titles if t != "time (UTC)"), \
            (c["title"], titles)


def test_counts_match_what_the_clients_received(reader, dashboard_env, replay):
    """The noisy-neighbour table counts, per tenant, every request the clients completed or
    dropped (one usage event each) and, for tenants without dropped streams, exactly the tokens
    the gateway reported to the client."""
    dashboard_env(server=reader.url, key=KEYS["admin"])
    at = run_page("tenants")
    table = ranking_table(at)
    got = dict(zip(table["tenant_id"], table["requests"], strict=True))
    assert got == {t: replay.billed_requests(t) for t in TENANTS if replay.billed_requests(t)}
    tokens = dict(zip(table["tenant_id"], table["total_tokens"], strict=True))
    for tenant in ("acme", "umbrella", "hobbyist"):
        ok = replay.ok[tenant]
        assert tokens[tenant] == ok["input_tokens"] + ok["output_tokens"]
    # the noisy neighbour sends few requests but carries the most tokens and KV
    ranks = {row["tenant_id"]: row for row in table.to_dict("records")}
    assert ranks["umbrella"]["rank_by_kv"] == 1 and ranks["umbrella"]["rank_by_tokens"] == 1
    assert ranks["umbrella"]["rank_by_requests"] > 1

    overview = run_page("overview")
    total = sum(replay.billed_requests(t) for t in TENANTS)
    mean_rps = next(m.value for m in overview.metric if m.label == "Requests / s (mean)")
    assert mean_rps == si(total / (15 * 60))  # the 15-minute window, pinned after the replay


def test_rejections_and_aborts_are_shown(reader, dashboard_env, replay):
    assert replay.rejected.get("hobbyist"), "the workload must overrun hobbyist's concurrency limit"
    dashboard_env(server=reader.url, key=KEYS["admin"])
    at = run_page("quota")
    refused = next(df.value for df in at.dataframe if "reason" in df.value.columns)
    hobby = refused[(refused["tenant_id"] == "hobbyist") & (refused["status"] == "rejected")]
    assert hobby["attempts"].sum() == replay.rejected["hobbyist"]
    assert set(hobby["status_code"]) == {429}
    billing = run_page("billing")
    recon = next(df.value for df in billing.dataframe if "unexplained_drift_tokens" in df.value.columns)
    by_tenant = recon.set_index("tenant_id")
    for tenant in TENANTS:
        assert by_tenant.loc[tenant, "ledger_requests"] == replay.billed_requests(tenant)
    assert replay.aborted, "the workload must drop streams"
    for tenant in TENANTS:
        # a dropped stream is billed from the engine's own account of it (the vLLM scheduler
        # hook): matched against the engine's record like a finished request, not an explained
        # "aborted" difference
        assert by_tenant.loc[tenant, "matched_requests"] == replay.billed_requests(tenant)
        assert by_tenant.loc[tenant, "aborted_requests"] == 0
    assert len(billing.get("download_button")) == 4  # invoice and reconciliation, CSV and Parquet


def test_noisy_neighbours_counts_every_attempt_and_states_each_detector(reader, dashboard_env, replay):
    """The noisy-neighbour table holds, per tenant, the engine-true input tokens the clients were
    told about (tenants without dropped streams) and one usage row per attempt; the replay sends no
    Idempotency-Key, so no retry can be seen; at its rates (a few requests a second over 15
    minutes) no detector fires."""
    dashboard_env(server=reader.url, key=KEYS["admin"])
    at = run_page("noisy")
    assert_clean(at)
    table = next(df.value for df in at.dataframe if "prompt_cache_hit_ratio" in df.value.columns)
    rows = table.set_index("tenant_id")
    assert set(rows.index) == {t for t in TENANTS if replay.billed_requests(t)}
    for tenant in rows.index:
        assert rows.loc[tenant, "attempts"] == replay.billed_requests(tenant)
        assert rows.loc[tenant, "prompt_cache_hit_ratio"] == (
            rows.loc[tenant, "cached_input_tokens"] / rows.loc[tenant, "input_tokens"])
    for tenant in ("acme", "umbrella", "hobbyist"):
        assert rows.loc[tenant, "input_tokens"] == replay.ok[tenant]["input_tokens"]
    assert (table["retries"] == 0).all() and (table["keyed_logical_requests"] == 0).all()
    states = next(df.value for df in at.dataframe if "state" in df.value.columns)
    ledger = states[states["detector"].isin([CACHE, RETRIES])]
    assert len(ledger) == 2 * len(table)
    # the signal history's detectors: one row per tenant with engine work (prefill, decode) and per
    # tenant the scheduler sampled (queue, KV); a few requests over 5 minutes is no pressure
    assert {PREFILL, DECODE, QUEUE, KV} <= set(states["detector"])
    assert set(states[states["detector"] == PREFILL]["tenant_id"]) <= set(table["tenant_id"])
    # agent loops: acme's research run made its 2 model calls (dashkit.agent_runs; the loop run made
    # tool calls only), no other tenant ran an agent
    assert (rows.loc["acme", "agent_model_calls"], rows.loc["acme", "agent_runs"]) == (2, 1)
    assert rows.loc["acme", "model_calls_per_agent_run"] == 2.0
    assert (table[table["tenant_id"] != "acme"]["agent_model_calls"] == 0).all()
    agent = states[states["detector"] == AGENT]
    assert list(agent["tenant_id"]) == ["acme"] and list(agent["value"]) == [2.0]
    # its history: acme's calls per run per bucket (2 calls of one run: 2.0, or 1.0 in each of two
    # buckets if they straddle one), and the detector's threshold drawn from NoisyThresholds
    tables = [t.to_pydict() for t in dataset_frames(at, "Model calls per agent run per tenant")]
    line = next(t for t in tables if "model_calls_per_agent_run" in t)
    assert set(line["tenant_id"]) == {"acme"} and sum(line["model_calls"]) == 2
    assert set(line["model_calls_per_agent_run"]) <= {1.0, 2.0}
    assert [t["value"] for t in tables if "label" in t] == [[THRESHOLDS.agent_calls_per_run_above]]
    assert set(states["state"]) == {"quiet"}, states.to_string()
    assert any("No tenant sent a request with an Idempotency-Key" in c.value for c in at.caption)
    # the interference panel: its rows (when a request missed its tier's objective on this machine's
    # load) hold shares that sum to 1 per victim, objective and quantity; else it says none missed
    assert any("Interference" in h.value for h in at.subheader)
    frames = [df.value for df in at.dataframe if "prefill_share" in df.value.columns]
    if frames:
        for _, group in frames[0].dropna(subset=["prefill_share"]).groupby(["tenant_id", "objective"]):
            assert abs(group["prefill_share"].sum() - 1.0) < 1e-9
    else:
        assert any("No request missed its tier's TTFT or ITL objective" in c.value for c in at.caption)


def test_admin_tenant_filter_narrows_every_read(reader, dashboard_env):
    dashboard_env(server=reader.url, key=KEYS["admin"])
    from streamlit.testing.v1 import AppTest
    from apptest import APP

    at = AppTest.from_file(str(APP), default_timeout=180)
    at.session_state["tenant_filter"] = ["umbrella"]
    at.run()
    at.switch_page("page_scripts/tenants.py").run()
    assert_clean(at)
    assert set(ranking_table(at)["tenant_id"]) == {"umbrella"}


# --------------------------------------------------------------------------- tenant scope


def test_only_an_admin_gets_the_tenant_picker(reader, dashboard_env):
    # (sidebar elements are read from the first run: AppTest drops them from its tree on reruns)
    dashboard_env(server=reader.url, key=KEYS["admin"])
    assert [m.label for m in run_page("overview").sidebar.multiselect] == ["Tenants"]
    dashboard_env(server=reader.url, key=KEYS["acme"])
    tenant = run_page("overview")
    assert not tenant.sidebar.multiselect
    assert any("Tenant: **acme**" in c.value for c in tenant.sidebar.caption)


def test_a_tenant_key_sees_only_its_own_tenant(reader, dashboard_env):
    dashboard_env(server=reader.url, key=KEYS["acme"])
    at = run_page("tenants")
    assert_clean(at)
    assert set(ranking_table(at)["tenant_id"]) == {"acme"}
    kv = run_page("kv")
    consumers = next(df.value for df in kv.dataframe if "kv_share" in df.value.columns)
    assert set(consumers["tenant_id"]) == {"acme"}
    assert all(c["title"] != "KV watermark — used ÷ total KV blocks (platform, max per bucket)" for c in charts(kv))
    billing = run_page("billing")
    assert_clean(billing)
    lines = next(df.value for df in billing.dataframe if "line_type" in df.value.columns)
    assert set(lines["tenant_id"]) == {"acme"}
    gpu = run_page("gpu")
    assert_clean(gpu)
    assert not charts(gpu) and "admin key" in gpu.info[0].value
    noisy = run_page("noisy")  # shares compare tenants: none for a tenant key, its own ledger rows only
    assert_clean(noisy)
    assert not any(c["title"].startswith(("Share of scheduled", "Share of the fair queues", "Share of active KV"))
                   for c in charts(noisy))
    assert any("admin keys only" in c.value for c in noisy.caption)
    states = next(df.value for df in noisy.dataframe if "state" in df.value.columns)
    assert set(states["tenant_id"]) == {"acme"} and {CACHE, RETRIES, AGENT} <= set(states["detector"]) <= {
        CACHE, RETRIES, AGENT, THRASH}  # (the re-prefill signal is the tenant's own: shown when it re-prefilled)
    # calls per agent run is the tenant's own ledger rows: acme sees its history, nobody else's
    line = next(t.to_pydict() for t in dataset_frames(noisy, "Model calls per agent run per tenant")
                if "model_calls_per_agent_run" in t.column_names)
    assert set(line["tenant_id"]) == {"acme"}
    dashboard_env(server=reader.url, key=KEYS["umbrella"])
    other = run_page("noisy")  # umbrella ran no agent: no history, no detector row, not acme's
    assert_clean(other)
    assert not any(c["title"].startswith("Model calls per agent run") for c in charts(other))
    assert any("No model call of an agent run" in c.value for c in other.caption)
    other_states = next(df.value for df in other.dataframe if "state" in df.value.columns)
    assert set(other_states["tenant_id"]) == {"umbrella"} and AGENT not in set(other_states["detector"])


def ranking_table(at):
    """The noisy-neighbour table of the tenants page (a pandas frame, raw column names)."""
    return next(df.value for df in at.dataframe if "rank_by_tokens" in df.value.columns)


def _window(replay) -> Window:
    end = datetime.fromisoformat(replay.until)
    return Window.ending(15 * 60, end)


def test_the_read_api_refuses_another_tenants_data(reader, replay):
    params = _window(replay).to_query()
    url = f"{reader.url}/v1/usage/dash/read/tenant_totals"
    acme = {"authorization": f"Bearer {KEYS['acme']}"}
    r = httpx.get(url, params={**params, "tenant": "globex"}, headers=acme)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_tenant"
    own = httpx.get(url, params=params, headers=acme)
    assert own.status_code == 200 and {row["tenant_id"] for row in own.json()} == {"acme"}
    admin = httpx.get(url, params=params, headers={"authorization": f"Bearer {KEYS['admin']}"})
    assert {row["tenant_id"] for row in admin.json()} == set(TENANTS)
    assert httpx.get(url, params=params, headers={"authorization": "Bearer sk-nope"}).status_code == 401
    assert httpx.get(url, params=params).status_code == 401
    # platform-wide signals (no tenant label) are admin-only
    gauge = f"{reader.url}/v1/usage/dash/signal_gauge"
    q = {**params, "name": "kvmeter_engine_kv_watermark_ratio"}
    assert httpx.get(gauge, params=q, headers=acme).json() == []
    assert httpx.get(gauge, params=q, headers={"authorization": f"Bearer {KEYS['admin']}"}).json()


def test_http_source_scoping(reader, replay):
    window = _window(replay)
    raw = HttpSource(reader.url, KEYS["acme"])
    try:
        viewer = raw.whoami()
        assert viewer.tenant_id == "acme" and not viewer.admin
        scoped = ScopedSource(raw, viewer)
        with pytest.raises(ScopeError):
            scoped.read("tenant_totals", window, ["globex"])  # refused client-side
        with pytest.raises(ScopeError):
            raw.read("tenant_totals", window, ["globex"])  # and by the server (403)
        assert {r["tenant_id"] for r in scoped.read("traffic_by_tenant", window)} == {"acme"}
        with pytest.raises(ScopeError):
            scoped.invoice(window.period, "umbrella")
    finally:
        raw.close()
    with pytest.raises(SignInError):
        HttpSource(reader.url, "sk-unknown").whoami()



def test_dashboard_start_check_refuses_a_key_the_server_refuses_and_warns_when_it_is_away(reader, capsys):
    from kvmeter.dashboards.cli import check_server
    from kvmeter.dashboards.errors import ConfigError
    from tests.conftest import free_port

    check_server(reader.url, KEYS["acme"])  # a tenant key of that server: fine, nothing printed
    check_server(reader.url, None)  # no key: the sign-in form; the server answers /healthz
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="refused the API key") as refused:
        check_server(reader.url, "sk-not-a-key-of-this-server")
    assert "sk-not-a-key" not in str(refused.value)  # the key is never shown
    away = f"http://127.0.0.1:{free_port()}"
    check_server(away, KEYS["acme"], timeout_s=2)  # may still be starting: a warning, not an error
    assert "does not answer now" in capsys.readouterr().err
