"""The Streamlit entry point of ``kvmeter dashboard`` (``streamlit run`` this file).

Settings come from the environment (see :mod:`kvmeter.dashboards.config`; the CLI sets it).
Eleven pages, one file each under ``page_scripts/`` (not ``pages/``: Streamlit's legacy
multipage mode takes a ``pages/`` folder beside the main script for its own pages and serves a
deep link such as ``/replicas`` from it, without this script, until some session has run
``st.navigation``); the sidebar (sign-in, time range, tenant filter,
auto-refresh) is drawn here before the chosen page runs.
"""

from pathlib import Path

import streamlit as st

from kvmeter.dashboards import ui

HERE = Path(__file__).parent

#: (file under page_scripts/, title, icon) in menu order.
PAGES = (
    ("overview.py", "Overview", ":material/monitoring:"),
    ("kv.py", "KV cache", ":material/memory:"),
    ("latency.py", "Latency vs SLO", ":material/timer:"),
    ("tenants.py", "Tenants & fairness", ":material/balance:"),
    ("goodput.py", "Goodput", ":material/verified:"),
    ("quota.py", "Quota", ":material/block:"),
    ("noisy.py", "Noisy neighbours", ":material/campaign:"),
    ("agent_runs.py", "Agent runs", ":material/smart_toy:"),
    ("billing.py", "Billing & reconciliation", ":material/receipt_long:"),
    ("gpu.py", "GPU", ":material/developer_board:"),
    ("replicas.py", "Replicas", ":material/dns:"),
)

st.set_page_config(page_title="kvmeter", page_icon=":material/monitoring:", layout="wide")
navigation = st.navigation([st.Page(HERE / "page_scripts" / name, title=title, icon=icon, default=i == 0)
                            for i, (name, title, icon) in enumerate(PAGES)])
ui.sidebar()
navigation.run()
