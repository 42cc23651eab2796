"""Page render time over a day of 1,000,000 usage events and its signals (target ≤ 2 s per page).

The ledger is built once by :mod:`synth` (through the ledger's own write paths) under ``--dir``
and reused. Each page is then run with ``streamlit.testing.v1.AppTest`` — the whole script: the
sidebar (sign-in, tenant list), the page's data queries and the altair charts — and timed:

* **cold**: the query cache (``st.cache_data``) cleared before the page, so every query runs;
* **warm**: the same page again inside the cache TTL (what an auto-refresh inside one bucket costs).

Views: an admin key over every tenant, and a tenant key (``acme``: its own rows only), both on
"last 24 h" (10-minute buckets), in mode *b* (ClickHouse directly, the chDB path) and — with
``--server`` — mode *a* (through ``kvmeter serve``'s read API, in a thread of this process).

    .venv/bin/python bench/dashboards/bench_pages.py --dir var/bench/dashboards [--runs 3] [--server]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synth import DAY_START, build  # noqa: E402

APP = Path(__file__).resolve().parents[2] / "dashboards" / "app.py"
PAGES = ("overview", "kv", "latency", "tenants", "goodput", "quota", "billing", "gpu")
KEYS = {"admin": "sk-demo-admin-0001", "acme": "sk-demo-acme-0001"}


def _reset() -> None:
    import streamlit as st

    from kvmeter.dashboards import ui

    try:
        ui.backend().close()
    except Exception:  # noqa: BLE001
        pass
    ui.backend.clear()
    st.cache_data.clear()


def time_pages(runs: int) -> dict[str, dict[str, float]]:
    """Cold and warm AppTest run time of every page (median of ``runs``), seconds."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    out: dict[str, dict[str, float]] = {}
    at = AppTest.from_file(str(APP), default_timeout=600).run()  # connects, signs in
    assert not at.exception, [e.message for e in at.exception]
    for page in PAGES:
        cold, warm = [], []
        for _ in range(runs):
            st.cache_data.clear()
            at.switch_page(f"page_scripts/{page}.py")
            t = time.perf_counter()
            at.run()
            cold.append(time.perf_counter() - t)
            assert not at.exception and not at.error, (page, [e.message for e in at.exception],
                                                       [e.value for e in at.error])
            t = time.perf_counter()
            at.run()
            warm.append(time.perf_counter() - t)
        charts = len(at.get("vega_lite_chart"))
        out[page] = {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
                     "cold_max_s": max(cold), "charts": charts}
        print(f"  {page:9s} cold {out[page]['cold_s']:.2f} s (max {max(cold):.2f})  warm "
              f"{out[page]['warm_s']:.2f} s  {charts} charts", file=sys.stderr, flush=True)
    return out


class _Reader:
    """``kvmeter serve`` (instant engine) on the bench ledger in a thread, dashboard routes mounted."""

    def __init__(self, directory: Path) -> None:
        import uvicorn
        from prometheus_client import CollectorRegistry

        from kvmeter.dashboards.routes import serve_routes
        from kvmeter.serving.config import load_serve_config
        from kvmeter.serving.runtime import ServeRuntime
        from kvmeter.net import free_port

        self.port = free_port()
        config = load_serve_config(None, {("server", "port"): self.port,
                                          ("ledger_dsn",): f"chdb://{directory / 'chdb'}",
                                          ("spool_dir",): str(directory / "spool"), ("engine", "kind"): "instant"},
                                   env={})
        runtime = ServeRuntime(config, registry=CollectorRegistry())
        self.dash = serve_routes(runtime)
        app = runtime.app()
        app.router.routes.extend(self.dash.routes)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive()
            time.sleep(0.1)

    def stop(self) -> None:
        self.dash.close()
        self.server.should_exit = True
        self.thread.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("var/bench/dashboards"))
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="also time mode a (through the serve read API)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if not (args.dir / "chdb").exists():
        print(f"building the ledger in {args.dir} (once) ...", file=sys.stderr)
        print(build(args.dir, events=args.events), file=sys.stderr)
    end = datetime.fromtimestamp(DAY_START + 86400, tz=timezone.utc).isoformat()
    base_env = {"KVMETER_DASHBOARD_UNTIL": end, "KVMETER_DASHBOARD_RANGE": "last 24 h",
                "KVMETER_DASHBOARD_REFRESH_S": "0"}
    print(f"# dashboards page bench — {platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
          file=sys.stderr)
    results: dict[str, dict] = {}
    modes = [("dsn", {"KVMETER_LEDGER_DSN": f"chdb://{(args.dir / 'chdb').resolve()}"})]
    reader = None
    try:
        for mode, mode_env in modes + ([("server", None)] if args.server else []):
            if mode == "server":
                _reset()  # release this process's chDB client before serve opens the path
                reader = _Reader(args.dir)
                mode_env = {"KVMETER_DASHBOARD_SERVER": f"http://127.0.0.1:{reader.port}"}
            for who, key in KEYS.items():
                _reset()
                for var in ("KVMETER_LEDGER_DSN", "KVMETER_DASHBOARD_SERVER"):
                    os.environ.pop(var, None)
                os.environ.update({**base_env, **mode_env, "KVMETER_DASHBOARD_API_KEY": key})
                print(f"## mode {mode}, {who} key", file=sys.stderr)
                results[f"{mode}/{who}"] = time_pages(args.runs)
    finally:
        _reset()
        if reader is not None:
            reader.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    worst = max(p["cold_s"] for r in results.values() for p in r.values())
    print(json.dumps(results, indent=1))
    print(f"worst cold page: {worst:.2f} s (target ≤ 2 s)", file=sys.stderr)


if __name__ == "__main__":
    main()
