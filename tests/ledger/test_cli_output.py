"""What ``kvmeter billing report|reconcile`` print, as a user sees it (a subprocess per command,
stdout and stderr captured apart): the result and its one summary line, no library INFO logs unless
``-v``; a ledger another process holds is one ``error:`` line, never chDB's raw text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ledgerkit import fill_ledger, read_api_in_thread

from kvmeter.serving.tenancy import Principal

ACME = Principal("acme", "paid_interactive", "ws1", "proj1", "k")

NO_LEDGER_ENV = ("KVMETER_LEDGER_DSN", "KVMETER_SPOOL_DIR", "KVMETER_API_KEY")


def kvmeter(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console command in a clean environment (no ledger variables) and directory."""
    env = {k: v for k, v in os.environ.items() if k not in NO_LEDGER_ENV}
    return subprocess.run([sys.executable, "-m", "kvmeter.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("action", ["report", "reconcile"])
async def test_a_held_embedded_ledger_is_one_error_line_not_chdbs_text(action, open_ledger, config, tmp_path):
    ledger = open_ledger()  # this process plays `kvmeter serve`: it holds the chDB path and the spool
    await fill_ledger(ledger, 6, keys_per_tenant=1)
    free_spool = tmp_path / "free-spool"
    free_spool.mkdir()  # a spool directory nobody holds: the command opens the Ledger (chDB next)
    for spool in ([], ["--spool-dir", str(free_spool)]):  # [] = the default ./var/... (absent in cwd)
        run = kvmeter("billing", action, "--period", "2026-11", "--out", str(tmp_path / "out"),
                      "--ledger-dsn", config.dsn, *spool, cwd=tmp_path)
        assert run.returncode == 4, run.stderr
        assert run.stdout == ""
        assert _lines(run.stderr) == [
            f"error: the embedded ledger at {tmp_path / 'chdb'} is held by another process (a running "
            "`kvmeter serve`?); read it through that process with --server URL --api-key KEY, or stop it "
            "first"], run.stderr  # no "Code: 76. DB::Exception: Cannot lock file ..." before it
    assert not (tmp_path / "out").exists()


async def test_a_free_ledger_prints_its_result_without_info_logs_unless_verbose(open_ledger, config, tmp_path):
    ledger = open_ledger()
    await fill_ledger(ledger, 6, keys_per_tenant=1)
    ledger.close()  # free: the command opens it itself, spool and all (the Ledger logs "ledger open")
    source = ["--ledger-dsn", config.dsn, "--spool-dir", str(config.spool_dir)]
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "a"), "--formats", "csv",
                  *source, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert _lines(run.stdout) == [str(tmp_path / "a" / "billing-2026-11.csv")]
    assert _lines(run.stderr) == ["2 invoice lines, 2 tenants, total 0.00 USD"], run.stderr
    run = kvmeter("billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path / "a"), "--formats", "csv",
                  *source, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert _lines(run.stderr) == ["2 tenant(s): no unexplained drift above 0"], run.stderr
    # -v (before or after the command) brings the INFO lines back; --log-level wins over the default
    for args in (["-v", "billing", "report"], ["billing", "report", "-v"],
                 ["--log-level", "info", "billing", "report"]):
        run = kvmeter(*args, "--period", "2026-11", "--out", str(tmp_path / "b"), "--formats", "csv", *source,
                      cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert " INFO kvmeter.ledger.ledger: ledger open: " in run.stderr, (args, run.stderr)
        assert _lines(run.stdout) == [str(tmp_path / "b" / "billing-2026-11.csv")], args  # logs never on stdout


def test_a_bad_log_level_is_a_usage_error(tmp_path):
    run = kvmeter("--log-level", "loud", "billing", "prices", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--log-level: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got 'loud'" in run.stderr


async def test_reading_through_the_serve_process_shows_no_httpx_lines_unless_verbose(open_ledger, tmp_path):
    ledger = open_ledger()
    await fill_ledger(ledger, 6, keys_per_tenant=1)
    with read_api_in_thread(ledger, {"sk-acme": ACME}) as url:
        via = ["--server", url, "--api-key", "sk-acme"]
        # the subprocess blocks this thread; the read API answers from its own thread
        run = kvmeter("billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path / "a"), "--formats", "csv",
                      *via, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert _lines(run.stdout) == [str(tmp_path / "a" / "reconcile-2026-11.csv")]
        assert _lines(run.stderr) == ["1 tenant(s): no unexplained drift above 0"], run.stderr
        run = kvmeter("-v", "billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path / "b"),
                      "--formats", "csv", *via, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert " INFO httpx: HTTP Request: GET http://127.0.0.1:" in run.stderr, run.stderr
