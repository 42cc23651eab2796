"""``kvmeter serve --workers N``: what refuses several workers (an engine, quota store or ledger one
process would own), and the spool slots each worker claims (the lowest no live process holds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmeter.serving.config import load_serve_config
from kvmeter.serving.runtime import ledger_config_of
from kvmeter.serving.workers import claim_slot, worker_spool_dir, workers_problem

SHARED = {("server", "workers"): 2, ("engine", "kind"): "instant", ("quota_store",): "redis://127.0.0.1:6379/0",
          ("ledger_dsn",): "http://default:@127.0.0.1:8123/kvmeter"}


def problem(**changes) -> str | None:  # noqa: ANN003
    overrides = {**SHARED, **{tuple(k.split("__")): v for k, v in changes.items()}}
    config = load_serve_config(None, overrides, env={})
    return workers_problem(config, ledger_config_of(config))


def test_a_shared_engine_quota_store_and_ledger_run_several_workers():
    assert problem() is None
    assert problem(engine__kind="remote") is None
    assert problem(quota_store="rediss://redis:6380/1") is None


@pytest.mark.parametrize("change, why", [
    ({"engine__kind": "vllm"}, "needs a shared engine: the in-process vLLM engine would load one copy"),
    ({"quota_store": "memory://"}, "needs a shared quota store: with memory:// every worker would enforce its own"),
    ({"ledger_dsn": "chdb:///tmp/x/chdb"}, "the embedded chDB ledger (chdb:///tmp/x/chdb) opens in one process only"),
])
def test_what_one_process_would_own_refuses_several_workers(change, why):
    assert why in problem(**change)


def test_one_worker_is_never_refused():
    assert problem(server__workers=1, engine__kind="vllm", quota_store="memory://", ledger_dsn="chdb:///x") is None


CLAIM = textwrap.dedent("""
    import sys
    from kvmeter.serving.workers import claim_slot
    print(claim_slot(sys.argv[1]))
""")


def claim_in_another_process(root: Path) -> int:
    """The slot a process claims, then exits (its claim goes with it)."""
    out = subprocess.run([sys.executable, "-c", CLAIM, str(root)], check=True, capture_output=True, text=True,
                         timeout=60)
    return int(out.stdout)


def test_each_worker_claims_the_lowest_slot_no_live_process_holds(tmp_path):
    root = tmp_path / "spool"
    assert claim_slot(root) == 0  # held by this process until it exits
    assert claim_slot(root) == 1
    assert claim_in_another_process(root) == 2
    assert claim_in_another_process(root) == 2  # the exited process's slot is free again
    assert worker_spool_dir(root, 2) == root / "worker-2"


def test_cli_refuses_a_per_process_quota_store_with_several_workers(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "kvmeter.cli", "serve", "--workers", "2", "--engine", "instant",
                               "--quota-store", "memory://", "--ledger-dsn", "http://default:@127.0.0.1:1/kvmeter",
                               "--spool-dir", str(tmp_path / "spool")], stdout=out, stderr=subprocess.STDOUT,
                              timeout=120).returncode
    text = log.read_text()
    assert code == 2, text
    assert "cannot start: --workers 2 needs a shared quota store" in text, text
    assert "Traceback" not in text and "Started parent process" not in text, text


def _child_levels(levels: dict, out) -> None:  # noqa: ANN001
    import logging

    from kvmeter.serving.workers import configure_worker_logging

    configure_worker_logging("INFO", levels)
    out.put({name: logging.getLogger(name).getEffectiveLevel() for name in ("httpx", "httpcore", "kvmeter")})


def test_a_spawned_worker_keeps_the_parents_quiet_libraries():
    """Without ``-v`` the CLI quiets httpx and httpcore; a worker is a fresh *spawned* process, so
    unless it is handed those levels it logs every upstream scrape (found by a newcomer: 47 httpx
    request lines in 40 s with ``--workers 2``)."""
    import argparse
    import logging
    import multiprocessing

    from kvmeter.cli import CHATTY_LIBRARIES, configure_logging
    from kvmeter.serving.workers import logger_levels

    before = {name: logging.getLogger(name).level for name in CHATTY_LIBRARIES}
    try:
        configure_logging(argparse.Namespace(verbose=False, log_level=None, command="serve"))
        levels = logger_levels()
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_child_levels, args=(levels, out))
        child.start()
        got = out.get(timeout=60)
        child.join(60)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
    assert got["httpx"] == got["httpcore"] == logging.WARNING
    assert got["kvmeter"] == logging.INFO


def test_the_workers_supervisor_waits_the_configured_time_for_a_worker_to_answer():
    """uvicorn kills a worker that does not answer its liveness ping within
    ``timeout_worker_healthcheck`` (default 5 s): on a loaded machine kvmeter's workers were
    killed while still building their runtime. The serve config sets it (default 60 s)."""
    from kvmeter.serving.workers import workers_uvicorn_config

    config = load_serve_config(None, SHARED, env={})
    assert config.server.worker_healthcheck_timeout_s == 60
    assert workers_uvicorn_config(config).timeout_worker_healthcheck == 60
    slower = load_serve_config(None, {**SHARED, ("server", "worker_healthcheck_timeout_s"): 180}, env={})
    uv = workers_uvicorn_config(slower)
    assert uv.timeout_worker_healthcheck == 180 and uv.workers == 2 and uv.factory
