"""``kvmeter serve`` for the benchmarks, with one switch ``kvmeter serve`` does not have:
``--unlimited`` replaces the quota gate with :class:`~kvmeter.serving.quota.UnlimitedQuota`
(the no-op baseline: same gateway, auth, scheduler, metering and ledger, no quota work).

Every other flag is ``kvmeter serve``'s, and the process is built and run exactly as
:func:`kvmeter.serving.serve_cmd.run` does (same ``ServeRuntime``, same uvicorn settings), so the
variants differ only in the quota::

    .venv/bin/python bench/quota/serve_variant.py [--unlimited] --engine instant --port 9001 ...
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from kvmeter.serving import serve_cmd
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.quota import UnlimitedQuota
from kvmeter.serving.runtime import ServeRuntime


class _NullRecorder:
    """Drops what the gateway records (``--diag-null-recorder``); never for figures reported as
    the gateway's."""

    async def record(self, event) -> None:
        return None

    async def record_attempt(self, attempt) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    serve_cmd.add_arguments(parser)
    parser.add_argument("--unlimited", action="store_true", help="UnlimitedQuota instead of the quota")
    parser.add_argument("--quota-replicas", type=int, default=None, help="replicas sharing the quota store")
    parser.add_argument("--diag-null-recorder", action="store_true",
                        help="diagnosis only (attributing the gateway's cost): usage events and attempts "
                             "are dropped instead of written to the ledger")
    parser.add_argument("--diag-no-bus-subscribers", action="store_true",
                        help="diagnosis only: unsubscribe the Prometheus exporter and the signal sampler "
                             "from the stats bus (what publishing to them costs)")
    parser.add_argument("--diag-gc", action="store_true",
                        help="diagnosis only: print the garbage collector's collections and time at exit")
    parser.add_argument("--diag-profile", metavar="FILE",
                        help="diagnosis only: cProfile the event-loop thread, stats written to FILE at exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    overrides = {
        ("server", "host"): args.host, ("server", "port"): args.port, ("server", "log_level"): "warning",
        ("engine", "kind"): args.engine, ("engine", "model"): args.model,
        ("engine", "max_model_len"): args.max_model_len, ("engine", "remote_url"): args.remote_url,
        ("tenants",): args.tenants, ("quota_store",): args.quota_store,
        ("quota_replicas",): args.quota_replicas, ("scheduler", "policy"): args.scheduler,
        ("ledger_dsn",): args.ledger_dsn, ("spool_dir",): args.spool_dir, ("prices",): args.prices,
    }
    config = load_serve_config(args.config, overrides)
    runtime = ServeRuntime(config)
    if args.unlimited:
        runtime.quota = runtime.gateway.quota = UnlimitedQuota()
    if args.diag_null_recorder:
        runtime.gateway.recorder = _NullRecorder()
    if args.diag_no_bus_subscribers:
        runtime.exporter.close()
        runtime.signals.close()
    server = uvicorn.Server(uvicorn.Config(
        runtime.app(), host=config.server.host, port=config.server.port, log_level="warning",
        lifespan="on", timeout_graceful_shutdown=30, access_log=False))
    if args.diag_gc:
        import atexit
        import gc
        import time

        spent = {0: 0.0, 1: 0.0, 2: 0.0}
        count = {0: 0, 1: 0, 2: 0}
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                spent[info["generation"]] += time.perf_counter() - started.pop()
                count[info["generation"]] += 1

        gc.callbacks.append(on_gc)
        atexit.register(lambda: print(f"gc: collections {count}, seconds {spent}", file=sys.stderr))
    if args.diag_profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            server.run()
        finally:
            profiler.disable()
            profiler.dump_stats(args.diag_profile)
    else:
        server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
