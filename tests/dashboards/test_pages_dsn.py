"""Every page under AppTest on the replay's ledger opened directly (mode *b*: a chDB path no
process holds — or a ClickHouse server), with API keys checked against the tenancy file."""

from __future__ import annotations

import pytest
from apptest import APP, PAGES, assert_clean, charts, run_page
from dashkit import KEYS
from streamlit.testing.v1 import AppTest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_every_page_renders_from_the_dsn(dsn_ledger, dashboard_env):
    dashboard_env(dsn=dsn_ledger, key=KEYS["admin"])
    at = run_page("overview")
    assert_clean(at)
    assert "ClickHouse" in " ".join(c.value for c in at.sidebar.caption)
    drawn = {}
    for page in PAGES[1:]:
        at.switch_page(f"page_scripts/{page}.py").run()
        assert_clean(at)
        drawn[page] = [c for c in charts(at) if c["rows"] > 0]
    assert all(drawn.values()), {p: len(c) for p, c in drawn.items()}


def test_a_tenant_key_is_scoped_in_the_data_layer_too(dsn_ledger, dashboard_env):
    dashboard_env(dsn=dsn_ledger, key=KEYS["umbrella"])
    at = run_page("tenants")
    assert_clean(at)
    table = next(df.value for df in at.dataframe if "rank_by_tokens" in df.value.columns)
    assert set(table["tenant_id"]) == {"umbrella"}
    quota = run_page("quota")
    assert_clean(quota)
    for df in quota.dataframe:
        if "tenant_id" in df.value.columns:
            assert set(df.value["tenant_id"]) <= {"umbrella"}


def _sign_in_with(key: str) -> AppTest:
    """Open the app without a start-up key and submit ``key`` in the sidebar form.

    (AppTest drops the sidebar's elements from its tree after a rerun of an ``st.navigation``
    app, so the form is used from the first run's tree and the outcome read from the page and
    the session state.)
    """
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    assert at.info and "Sign in" in at.info[0].value and not charts(at)
    at.sidebar.text_input(key="api_key_input").input(key)
    at.sidebar.button[0].click().run()
    return at


def test_sign_in_form(dsn_ledger, dashboard_env):
    dashboard_env(dsn=dsn_ledger, key="")
    refused = _sign_in_with("sk-not-a-key")
    assert refused.session_state["sign_in_error"] == "invalid API key"
    assert not charts(refused) and "Sign in" in refused.info[0].value
    assert refused.session_state["api_key_input"] == "", "the typed key is not kept in the widget"
    accepted = _sign_in_with(KEYS["acme"])
    assert_clean(accepted)
    assert charts(accepted) and accepted.session_state["kvmeter_session"].viewer.tenant_id == "acme"
