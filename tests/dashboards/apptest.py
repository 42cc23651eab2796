"""Running the dashboard app under ``streamlit.testing.v1.AppTest`` and reading what it drew."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[2] / "dashboards" / "app.py"
PAGES = ("overview", "kv", "latency", "tenants", "goodput", "quota", "noisy", "agent_runs", "billing", "gpu")


def run_page(page: str, timeout: float = 180) -> AppTest:
    """Run the app (sidebar + default page), then switch to ``page`` and run it."""
    at = AppTest.from_file(str(APP), default_timeout=timeout).run()
    if page != "overview":
        at.switch_page(f"page_scripts/{page}.py").run()
    return at


def _titles(spec: Any) -> list[str]:
    out: list[str] = []
    if isinstance(spec, dict):
        title = spec.get("title")
        if isinstance(title, dict) and isinstance(title.get("text"), str):
            out.append(title["text"])
        elif isinstance(title, str):
            out.append(title)
        for key in ("layer", "hconcat", "vconcat", "concat"):
            for sub in spec.get(key, []) or []:
                out.extend(_titles(sub))
    return out


def charts(at: AppTest) -> list[dict[str, Any]]:
    """Every vega-lite chart drawn: ``title`` (first title found), ``rows`` (data rows over its
    datasets), ``spec`` (the parsed spec)."""
    found = []
    for el in at.get("vega_lite_chart"):
        spec = json.loads(el.proto.spec)
        rows = sum(pa.ipc.open_stream(ds.data.data).read_all().num_rows for ds in el.proto.datasets)
        titles = _titles(spec)
        found.append({"title": titles[0] if titles else "", "rows": rows, "spec": spec})
    return found


def chart(at: AppTest, title_start: str) -> dict[str, Any]:
    """The chart whose title starts with ``title_start`` (AssertionError listing the titles if none)."""
    drawn = charts(at)
    for c in drawn:
        if c["title"].startswith(title_start):
            return c
    raise AssertionError(f"no chart titled {title_start!r}; drawn: {[c['title'] for c in drawn]}")


def assert_clean(at: AppTest) -> None:
    """No exception and no error box on the page."""
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def metric_labels(at: AppTest) -> list[str]:
    return [m.label for m in at.metric]


def dataset_frames(at: AppTest, title_start: str) -> list[pa.Table]:
    """The Arrow tables behind the chart titled ``title_start``."""
    for el in at.get("vega_lite_chart"):
        spec = json.loads(el.proto.spec)
        titles = _titles(spec)
        if titles and titles[0].startswith(title_start):
            return [pa.ipc.open_stream(ds.data.data).read_all() for ds in el.proto.datasets]
    raise AssertionError(f"no chart titled {title_start!r}")
