"""Money is exact: Decimal from the price file to the invoice line, rounded once per line."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path

import polars as pl
from ledgerkit import PERIOD, make_event

from kvmeter.ledger import load_price_list
from kvmeter.ledger.billing import invoice_lines, invoice_totals


def _dime_prices(tmp_path: Path):
    path = tmp_path / "prices.yaml"
    path.write_text("version: dime\ncurrency: USD\nrounding: {quantum: '0.01', mode: ROUND_HALF_EVEN}\n"
                    "tiers: {enterprise: 0.2}\n"
                    "models:\n  dime-model: {input: 100000, cached_input: 50000, output: 200000}\n")
    return load_price_list(path)  # one input token costs exactly 0.10


async def test_ten_events_of_ten_cents_total_exactly_one_dollar(open_ledger, tmp_path: Path) -> None:
    prices = _dime_prices(tmp_path)
    ledger = open_ledger(prices=prices)
    # ten separate invoice lines (one API key each), each one event of one input token = 0.10
    await asyncio.gather(*(ledger.record(make_event(i, model="dime-model", input_tokens=1, output_tokens=0,
                                                     api_key_id=f"key-{i}")) for i in range(10)))
    assert ledger.flush()
    lines = invoice_lines(ledger.queries.invoice_usage(PERIOD), ledger.queries.invoice_attempts(PERIOD),
                          ledger.queries.adjustments(PERIOD), prices, PERIOD)
    assert lines.height == 10
    assert lines["cost"].to_list() == [Decimal("0.10")] * 10
    (total,) = invoice_totals(lines)["total"].to_list()
    assert total == Decimal("1.00")
    assert sum([0.10] * 10) != 1.0  # what binary floats would have billed
    assert ledger.queries.usage_summary(PERIOD)[0]["cost"] == Decimal("1.00")


async def test_thousand_requests_of_25_input_tokens_at_30_cents_per_million(open_ledger) -> None:
    ledger = open_ledger()
    await asyncio.gather(*(ledger.record(make_event(i, input_tokens=25, output_tokens=0))
                           for i in range(1000)))
    assert ledger.flush()
    lines = invoice_lines(ledger.queries.invoice_usage(PERIOD), [], [], ledger.prices, PERIOD)
    (line,) = lines.to_dicts()
    assert line["input_tokens"] == 25_000
    assert line["subtotal"] == Decimal("0.0075")  # exact before invoice rounding
    assert line["cost"] == Decimal("0.01")  # ROUND_HALF_EVEN to 0.01, once


def test_rounding_happens_once_per_line_half_even(tmp_path: Path) -> None:
    path = tmp_path / "half.yaml"
    path.write_text("version: h\ncurrency: USD\nmodels:\n  m: {input: 5000, cached_input: 0, output: 0}\n")
    half = load_price_list(path)  # one input token = 0.005
    usage = [{"tenant_id": "t", "workspace_id": "w", "project_id": "p", "api_key_id": k, "model": "m",
              "tier": "free", "requests": 1, "aborted_requests": 0, "error_requests": 0, "input_tokens": n,
              "cached_input_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0, "kv_token_seconds": 0.0}
             for k, n in (("a", 1), ("b", 1), ("c", 3))]
    lines = invoice_lines(usage, [], [], half, PERIOD)
    assert lines["subtotal"].to_list() == [Decimal("0.005"), Decimal("0.005"), Decimal("0.015")]
    assert lines["cost"].to_list() == [Decimal("0.00"), Decimal("0.00"), Decimal("0.02")]  # ties to even
    assert invoice_totals(lines)["total"].to_list() == [Decimal("0.02")]  # sum of rounded lines
    assert half.round(Decimal("0.125")) == Decimal("0.12")


def test_cached_and_reasoning_tokens_are_parts_not_additions() -> None:
    prices = load_price_list()
    usage = [{"tenant_id": "t", "workspace_id": "w", "project_id": "p", "api_key_id": "k",
              "model": "DeepSeek-R1-Distill-Qwen-32B", "tier": "enterprise", "requests": 3, "aborted_requests": 0,
              "error_requests": 0, "input_tokens": 1_000_000, "cached_input_tokens": 400_000,
              "output_tokens": 500_000, "reasoning_tokens": 200_000, "kv_token_seconds": 1.0}]
    attempts = [{k: usage[0][k] for k in ("tenant_id", "workspace_id", "project_id", "api_key_id",
                                           "model", "tier")} | {"attempts": 5, "rejected_attempts": 2,
                                                                "replayed_attempts": 0}]
    (line,) = invoice_lines(usage, attempts, [], prices, PERIOD).to_dicts()
    # list: input 0.75, cached 0.1875, output 0.99, reasoning 0.99 per M; enterprise 20 % off
    expected = (Decimal("0.6") * Decimal("0.75") + Decimal("0.4") * Decimal("0.1875")
                + Decimal("0.3") * Decimal("0.99") + Decimal("0.2") * Decimal("0.99")) * Decimal("0.8")
    assert line["subtotal"] == expected == Decimal("0.816")
    assert (line["input_tokens"], line["cached_input_tokens"], line["output_tokens"], line["reasoning_tokens"]) == \
        (1_000_000, 400_000, 500_000, 200_000)
    assert (line["requests"], line["attempts"], line["rejected_attempts"]) == (3, 5, 2)


def test_unpriced_models_are_flagged_not_silently_zero() -> None:
    usage = [{"tenant_id": "t", "workspace_id": "", "project_id": "", "api_key_id": "",
              "model": "mystery-model", "tier": "free", "requests": 1, "aborted_requests": 0, "error_requests": 0,
              "input_tokens": 5, "cached_input_tokens": 0, "output_tokens": 5, "reasoning_tokens": 0,
              "kv_token_seconds": 0.0}]
    (line,) = invoice_lines(usage, [], [], load_price_list(), PERIOD).to_dicts()
    assert line["priced"] is False and line["cost"] is None and "price list" in line["note"]


def test_adjustments_become_signed_lines_and_files_keep_exact_decimals(tmp_path: Path) -> None:
    prices = load_price_list()
    adjustments = [{"adjustment_id": f"a{i}", "tenant_id": "t", "amount": Decimal("-0.10"), "reason": "credit"}
                   for i in range(10)]
    lines = invoice_lines([], [], adjustments, prices, PERIOD)
    assert lines["line_type"].to_list() == ["adjustment"] * 10
    assert invoice_totals(lines)["total"].to_list() == [Decimal("-1.00")]
    lines.write_parquet(tmp_path / "x.parquet")
    back = pl.read_parquet(tmp_path / "x.parquet")
    assert back["cost"].sum() == Decimal("-1.00") and back.schema["subtotal"] == pl.Decimal(38, 18)
