"""``kvmeter billing`` end to end, as a user runs it (a subprocess per command)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import polars as pl
import pytest
from ledgerkit import fill_ledger, make_attempt, make_event, read_api_in_thread

from kvmeter.cli import build_parser, main
from kvmeter.serving.tenancy import Principal

ACME = Principal("acme", "paid_interactive", "ws1", "proj1", "k")


def kvmeter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmeter.cli", *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def _source(config) -> list[str]:  # noqa: ANN001
    return ["--ledger-dsn", config.dsn, "--spool-dir", str(config.spool_dir)]


async def test_report_writes_csv_parquet_and_html(open_ledger, config, tmp_path: Path) -> None:
    ledger = open_ledger()
    await fill_ledger(ledger)
    ledger.close()  # the CLI is another process: it may open the embedded ledger only when free
    out = tmp_path / "out"
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(out), *_source(config))
    assert run.returncode == 0, run.stderr
    csv, parquet, html = (out / f"billing-2026-11.{ext}" for ext in ("csv", "parquet", "html"))
    lines = pl.read_parquet(parquet)
    assert lines.height == 4  # two tenants × two API keys each
    assert lines["requests"].sum() == 40 and lines["attempts"].sum() == 40
    assert lines["input_tokens"].sum() == 40 * 25
    assert pl.read_csv(csv).height == 4
    page = html.read_text()
    assert "acme" in page and "globex" in page and "ROUND_HALF_EVEN to 0.01 USD per invoice line" in page
    # 10 requests of 25 input + 10 output tokens per line: 0.000075 + 0.00006 = 0.000135 → 0.00
    assert set(lines["subtotal"].to_list()) == {Decimal("0.000135")}
    assert set(lines["cost"].to_list()) == {Decimal("0.00")}


async def test_reconcile_exit_status_follows_the_drift_threshold(open_ledger, config, tmp_path: Path) -> None:
    ledger = open_ledger()
    await fill_ledger(ledger, drift=True)
    ledger.close()
    run = kvmeter("billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path), *_source(config))
    assert run.returncode == 1, run.stderr
    assert "acme" in run.stderr
    report = pl.read_csv(tmp_path / "reconcile-2026-11.csv")
    assert dict(zip(report["tenant_id"], report["status"], strict=True)) == {"acme": "drift", "globex": "ok"}
    run = kvmeter("billing", "reconcile", "--period", "2026-11", "--max-drift-ratio", "0.01", "--out", str(tmp_path),
                  "--formats", "csv", *_source(config))
    assert run.returncode == 0, run.stderr


async def test_reconcile_names_each_view_outside_its_bound_and_by_how_much(open_ledger, config,
                                                                            tmp_path: Path) -> None:
    ledger = open_ledger()
    await fill_ledger(ledger, drift=True)  # acme's request 3: the engine counted 1 output token more
    lost = make_event(99, "globex")  # admitted, then neither an engine record nor a usage event
    await ledger.record_attempt(make_attempt(lost))
    assert ledger.flush()
    ledger.close()
    args = ["billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path), "--formats", "csv",
            *_source(config)]

    run = kvmeter(*args, "--max-missing-finishes", "0")
    assert run.returncode == 1, run.stderr
    drift = [line for line in run.stderr.splitlines() if line.startswith("drift: ")]
    seen = 20 * (25 + 10)  # acme's 20 billed requests of 25 input + 10 output tokens
    assert drift == [
        f"drift: acme: engine view vs ledger: 1 token unexplained of {seen:,} (ratio {1 / seen:.6g} > bound 0): "
        "mismatched 1 request / 1 token",
        "drift: globex: gateway view vs ledger: 1 admitted attempt with no engine record and no usage event of "
        "21 admitted (bound 0; 89 reserved tokens)"], run.stderr  # reserved: 25 input + 64 output

    # each view within its bound: exit 0, no drift line
    run = kvmeter(*args, "--max-drift-ratio", "0.01", "--max-missing-finishes", "1")
    assert run.returncode == 0, run.stderr
    assert "drift: " not in run.stderr
    # only the engine view outside its bound: only its line
    run = kvmeter(*args, "--max-missing-finishes", "1")
    assert run.returncode == 1, run.stderr
    assert [line.split(": ")[1:3] for line in run.stderr.splitlines() if line.startswith("drift: ")] == [
        ["acme", "engine view vs ledger"]]


def test_reconcile_cannot_read_a_path_without_a_ledger(tmp_path: Path) -> None:
    run = kvmeter("billing", "reconcile", "--period", "2026-11", "--out", str(tmp_path / "out"),
                  "--ledger-dsn", f"chdb://{tmp_path / 'nowhere'}", "--spool-dir", str(tmp_path / "spool"))
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: ") and "no such directory" in run.stderr and "drift" not in run.stderr
    assert not (tmp_path / "out").exists()


async def test_unpriced_usage_fails_the_report(open_ledger, config, tmp_path: Path) -> None:
    ledger = open_ledger()
    await fill_ledger(ledger, unpriced=True)
    ledger.close()
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path), *_source(config))
    assert run.returncode == 3 and "mystery-model" in run.stderr


async def test_refused_attempts_of_an_unpriced_model_do_not_fail_the_report(open_ledger, config,
                                                                            tmp_path: Path) -> None:
    """A request to a model the price list does not price is refused (400 ``unpriced_model``):
    its attempt makes an invoice line of no tokens, which costs 0 under any list. Found by a
    newcomer: the report exited 3 ("1 line(s) use models the price list does not price") for it."""
    ledger = open_ledger()
    await fill_ledger(ledger)
    refused = make_event(99, "acme", model="mystery-model")
    await ledger.record_attempt(make_attempt(refused, status="rejected", status_code=400, reason="unpriced_model"))
    assert ledger.flush()
    ledger.close()
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path), "--formats", "csv",
                  *_source(config))
    assert run.returncode == 0, run.stderr
    lines = pl.read_csv(next(tmp_path.glob("billing-*.csv")))
    mystery = lines.filter(pl.col("model") == "mystery-model")
    assert mystery.height == 1
    assert mystery["priced"].to_list() == [True] and float(mystery["cost"][0]) == 0.0
    assert mystery["input_tokens"][0] == mystery["output_tokens"][0] == 0


def test_bad_arguments_exit_2_with_a_message(config) -> None:
    run = kvmeter("billing", "report", "--period", "Nov", *_source(config))
    assert run.returncode == 2 and "2026-11" in run.stderr  # the error shows valid forms
    run = kvmeter("billing", "report", "--period", "2026-11", "--prices", "/nonexistent.yaml", *_source(config))
    assert run.returncode == 2 and "cannot read price list" in run.stderr


async def test_a_held_ledger_is_read_through_the_serve_process(open_ledger, config, tmp_path: Path) -> None:
    ledger = open_ledger()  # this process plays `kvmeter serve`: it holds the embedded ledger
    await fill_ledger(ledger)
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path), *_source(config))
    assert run.returncode == 4 and "--server" in run.stderr
    other_spool = ["--dsn", config.dsn, "--spool-dir", str(tmp_path / "other-spool")]
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path), *other_spool)
    assert run.returncode == 4 and "held by another process" in run.stderr  # the chDB path itself

    with read_api_in_thread(ledger, {"sk-acme": ACME}) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmeter.cli", "billing", "report", "--period", "2026-11", "--out",
            str(tmp_path / "via-api"), "--server", url, "--api-key", "sk-acme",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 300)
        assert proc.returncode == 0, err.decode()
        lines = pl.read_parquet(tmp_path / "via-api" / "billing-2026-11.parquet")
        assert set(lines["tenant_id"]) == {"acme"} and lines["requests"].sum() == 20


@pytest.mark.parametrize("action", ["prices", "migrate"])
def test_maintenance_commands(action: str, config) -> None:
    args = ["billing", action] + (["--dsn", config.dsn] if action == "migrate" else [])
    run = kvmeter(*args)
    assert run.returncode == 0, run.stderr
    assert ("SmolLM2-135M-Instruct" in run.stdout) if action == "prices" else ("applied 1" in run.stdout)


# --------------------------------------------------------------------------- argument and DSN errors


def test_the_console_script_describes_itself_without_rest_markup() -> None:
    assert build_parser([]).description == "kvmeter — the one console script."


@pytest.mark.parametrize("action", ["report", "reconcile", "migrate"])
def test_ledger_dsn_is_the_documented_flag_and_dsn_an_alias(action: str, capsys) -> None:
    extra = ["--period", "2026-11"] if action != "migrate" else []
    for flag in ("--ledger-dsn", "--dsn"):
        args = build_parser(["billing"]).parse_args(["billing", action, *extra, flag, "chdb:///x"])
        assert args.dsn == "chdb:///x", flag
    with pytest.raises(SystemExit):
        build_parser(["billing"]).parse_args(["billing", action, "--help"])
    assert "--ledger-dsn DSN, --dsn DSN" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["report", "reconcile"])
def test_read_only_commands_refuse_a_path_without_a_ledger(action: str, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nonexistent" / "dir" / "x"
    not_a_ledger = tmp_path / "empty"
    not_a_ledger.mkdir()
    for path, why in ((missing, "no such directory"), (not_a_ledger, "not a kvmeter ledger")):
        status = main(["billing", action, "--period", "2026-11", "--ledger-dsn", f"chdb://{path}",
                       "--spool-dir", str(tmp_path / "spool"), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert status == 2 and err.startswith("error: ") and why in err and str(path) in err, err
        assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "nonexistent").exists() and not any(not_a_ledger.iterdir())
    assert not (tmp_path / "spool").exists() and not (tmp_path / "out").exists()


async def test_a_ledger_without_a_spool_directory_is_read_without_creating_one(open_ledger, config,
                                                                               tmp_path: Path) -> None:
    ledger = open_ledger()
    await fill_ledger(ledger)
    ledger.close()
    no_spool = tmp_path / "no-spool"
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "out"), "--formats", "csv",
                  "--dsn", config.dsn, "--spool-dir", str(no_spool))  # --dsn: the alias still works
    assert run.returncode == 0, run.stderr
    assert "4 invoice lines, 2 tenants, total 0.00 USD" in run.stderr
    assert not no_spool.exists()


def test_a_period_outside_the_ledger_range_is_a_usage_error(tmp_path: Path, capsys) -> None:
    status = main(["billing", "report", "--period", "0999", "--ledger-dsn", f"chdb://{tmp_path / 'x'}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "1900-01-01 .. 2299-12-31" in err and "\n" not in err
