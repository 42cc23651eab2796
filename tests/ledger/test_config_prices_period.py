"""LedgerConfig precedence and validation, price lists, billing periods (no ClickHouse needed)."""

from __future__ import annotations

import decimal
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from kvmeter.ledger import (ConfigError, LedgerConfig, PeriodError, PriceListError, UnpricedModel, load_price_list,
                            parse_period)
from kvmeter.ledger.config import parse_dsn, require_existing_ledger
from kvmeter.ledger.prices import parse_price_list
from kvmeter.tokens import TokenCounts


# --------------------------------------------------------------------------- config


def test_config_precedence_explicit_over_env_over_default(tmp_path: Path) -> None:
    env = {"KVMETER_LEDGER_DSN": "chdb:///env/chdb", "KVMETER_SPOOL_DIR": str(tmp_path / "env-spool")}
    from_env = LedgerConfig.from_env(env)
    assert from_env.parsed_dsn.path == "/env/chdb"
    assert from_env.spool_dir == tmp_path / "env-spool"
    explicit = LedgerConfig.from_env(env, dsn="chdb:///explicit", spool_dir=tmp_path / "x", batch_size=7)
    assert explicit.parsed_dsn.path == "/explicit"
    assert explicit.spool_dir == tmp_path / "x"
    assert explicit.batch_size == 7
    default = LedgerConfig.from_env({})
    assert default.dsn.startswith("chdb://") and default.dsn.endswith("var/ledger/chdb")
    assert default.embedded and default.cluster is None


def test_server_dsn_is_parsed_and_the_password_never_shown() -> None:
    cfg = LedgerConfig(dsn="https://bill:s3cret@ch.example:8443/metering")
    dsn = cfg.parsed_dsn
    assert (dsn.kind, dsn.host, dsn.port, dsn.username, dsn.password, dsn.secure, dsn.database) == \
        ("http", "ch.example", 8443, "bill", "s3cret", True, "metering")
    assert cfg.effective_database == "metering"
    assert "s3cret" not in repr(cfg) and "s3cret" not in dsn.redacted()
    assert parse_dsn("http://localhost").port == 8123


@pytest.mark.parametrize("dsn", ["", "postgres://x/y", "chdb://:memory:", "http:///nohost", "http://h/bad-db!"])
def test_bad_dsn_is_a_clear_config_error(dsn: str) -> None:
    with pytest.raises(ConfigError):
        LedgerConfig(dsn=dsn)


def test_a_read_only_command_refuses_a_chdb_path_without_a_ledger_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "ledger"
    with pytest.raises(ConfigError, match="no such directory"):
        require_existing_ledger(parse_dsn(f"chdb://{missing}"))
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        require_existing_ledger(parse_dsn(f"chdb://{tmp_path / 'file'}"))
    with pytest.raises(ConfigError, match="not a kvmeter ledger"):
        require_existing_ledger(parse_dsn(f"chdb://{tmp_path}"))
    (tmp_path / "metadata" / "kvmeter").mkdir(parents=True)
    (tmp_path / "metadata" / "kvmeter" / "schema_migrations.sql").write_text("ATTACH TABLE ...")
    require_existing_ledger(parse_dsn(f"chdb://{tmp_path}"))  # what a migrated chDB path holds
    with pytest.raises(ConfigError, match="'other'"):
        require_existing_ledger(parse_dsn(f"chdb://{tmp_path}"), "other")
    require_existing_ledger(parse_dsn("http://u:p@nowhere:8123/kv"))  # a server answers for itself


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("flush_interval_s", 0), ("segment_bytes", 10),
                                         ("database", "x;drop"), ("retry_max_s", 0.1)])
def test_out_of_range_config_values_fail_at_construction(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        LedgerConfig(dsn="chdb:///tmp/x", **{field: value})


def test_cluster_mode_needs_a_server() -> None:
    with pytest.raises(ConfigError, match="cluster"):
        LedgerConfig(dsn="chdb:///tmp/x", cluster="main")
    assert LedgerConfig(dsn="http://h:8123", cluster="main").cluster == "main"


def test_unknown_config_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        LedgerConfig.from_env({}, batchsize=3)


# --------------------------------------------------------------------------- prices


def test_packaged_price_list_prices_the_served_model_exactly() -> None:
    prices = load_price_list()
    smol = prices.price_for("SmolLM2-135M-Instruct")
    assert smol is not None and smol.input == Decimal("0.30") and smol.output == Decimal("0.60")
    assert smol.reasoning == smol.output  # defaults to the output price
    assert len(prices.models) >= 4
    assert prices.rounding == "ROUND_HALF_EVEN" and prices.quantum == Decimal("0.01")
    # 25 input tokens at 0.30 per million, 1,000 times: exactly 0.0075 before rounding
    unit = prices.unit_price("SmolLM2-135M-Instruct", "paid_interactive", "input")
    assert unit * 25 * 1000 == Decimal("0.0075")
    assert prices.round(Decimal("0.0075")) == Decimal("0.01")


def test_yaml_floats_are_read_as_exact_decimals(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: t\ncurrency: EUR\ntiers: {gold: 0.1}\n"
                    "models:\n  m: {input: 0.1, cached_input: 0.01, output: 0.2, reasoning: 0.3}\n")
    prices = load_price_list(path)
    m = prices.price_for("m")
    assert (m.input, m.cached_input, m.output, m.reasoning) == \
        (Decimal("0.1"), Decimal("0.01"), Decimal("0.2"), Decimal("0.3"))
    # ten tokens at 0.1 per token-million after a 10 % discount: exact, no binary float residue
    assert prices.unit_price("m", "gold", "input") * 10_000_000 == Decimal("0.9")
    assert prices.unit_price("m", "unknown-tier", "input") * 10_000_000 == Decimal("1.0")
    assert prices.unit_price("other", "gold", "input") is None


def test_the_price_function_prices_each_part_at_its_own_exact_price(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: t\ncurrency: USD\ntiers: {gold: 0.25}\n"
                    "models:\n  r: {input: 0.75, cached_input: 0.1875, output: 0.99, reasoning: 1.5}\n"
                    "  plain: {input: 0.30, cached_input: 0.03, output: 0.60}\n")
    prices = load_price_list(path)
    tokens = TokenCounts(input_tokens=4_000_001, cached_input_tokens=1_000_000, output_tokens=900_003,
                         reasoning_tokens=700_001)
    # (input − cached) × input + cached × cached_input + (output − reasoning) × output + reasoning ×
    # reasoning, per million, after the tier's discount: exact, never rounded
    list_price = (Decimal("3000001") * Decimal("0.75") + Decimal("1000000") * Decimal("0.1875")
                  + Decimal("200002") * Decimal("0.99") + Decimal("700001") * Decimal("1.5")) / 1_000_000
    assert prices.cost("r", "free", tokens) == list_price == Decimal("3.68550423")
    assert prices.cost("r", "gold", tokens) == list_price * Decimal("0.75")
    # a list without a reasoning price prices reasoning tokens as output
    assert prices.cost("plain", "free", tokens) == prices.cost("plain", "free", TokenCounts(
        input_tokens=4_000_001, cached_input_tokens=1_000_000, output_tokens=900_003))
    assert prices.cost("r", "free", TokenCounts()) == 0
    # the rounding point is the invoice line, not the price function
    assert prices.round(prices.cost("r", "free", tokens)) == Decimal("3.69")
    with pytest.raises(UnpricedModel, match="mystery"):
        prices.cost("mystery", "free", tokens)
    assert prices.cost_if_priced("mystery", "free", tokens) is None
    # counts far beyond any invoice stay exact (a 60-digit context that refuses to round)
    huge = TokenCounts(input_tokens=10**30, output_tokens=10**30 - 1, reasoning_tokens=1)
    with decimal.localcontext(prec=80):
        expected = (Decimal(10**30) * Decimal("0.75") + (Decimal(10**30) - 2) * Decimal("0.99")
                    + Decimal("1.5")) / 1_000_000 * Decimal("0.75")
    assert prices.cost("r", "gold", huge) == expected and len(expected.as_tuple().digits) > 28


@pytest.mark.parametrize("body,match", [
    ("version: t\ncurrency: USD\nmodels: {m: {input: 0.1234567, cached_input: 0, output: 0}}", "decimal places"),
    ("version: t\ncurrency: USD\nmodels: {m: {input: 1, cached_input: 0}}", "output"),
    ("version: t\ncurrency: USD\nmodels: {m: {input: 1, cached_input: 0, output: 1, video: 2}}", "unknown"),
    ("version: t\ncurrency: USD\nmodels: {m: {input: -1, cached_input: 0, output: 1}}", ">= 0"),
    ("version: t\ncurrency: USD\ntiers: {x: 1.5}\nmodels: {m: {input: 1, cached_input: 0, output: 1}}", r"\[0, 1\]"),
    ("version: t\ncurrency: dollars\nmodels: {m: {input: 1, cached_input: 0, output: 1}}", "ISO 4217"),
    ("version: t\ncurrency: USD\nrounding: {mode: ROUND_SOMETIMES}\n"
     "models: {m: {input: 1, cached_input: 0, output: 1}}", "rounding.mode"),
    ("version: t\ncurrency: USD\nmodels: {m: {input: abc, cached_input: 0, output: 1}}", "decimal"),
    ("[1, 2", "YAML"),
])
def test_invalid_price_lists_name_the_problem(tmp_path: Path, body: str, match: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(body)
    with pytest.raises(PriceListError, match=match):
        load_price_list(path)


def test_missing_price_file_is_a_price_list_error(tmp_path: Path) -> None:
    with pytest.raises(PriceListError, match="cannot read"):
        load_price_list(tmp_path / "nope.yaml")


def test_aliases_price_the_same_model_and_duplicates_are_refused() -> None:
    base = {"version": "v", "currency": "USD"}
    prices = parse_price_list(
        {**base, "models": {"m": {"input": 1, "cached_input": 0, "output": 2, "aliases": ["m2"]}}})
    assert prices.price_for("m2") is prices.price_for("m")
    with pytest.raises(PriceListError, match="twice"):
        parse_price_list({**base, "models": {"m": {"input": 1, "cached_input": 0, "output": 2, "aliases": ["m"]}}})


# --------------------------------------------------------------------------- periods


def _utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)


@pytest.mark.parametrize("text,start,end", [
    ("2026-11", _utc(2026, 11, 1), _utc(2026, 12, 1)),
    ("2026-12", _utc(2026, 12, 1), _utc(2027, 1, 1)),
    ("2026-11-29", _utc(2026, 11, 29), _utc(2026, 11, 30)),
    ("2026", _utc(2026, 1, 1), _utc(2027, 1, 1)),
    ("2026-11-01/2026-11-15", _utc(2026, 11, 1), _utc(2026, 11, 15)),
    ("2026-11-01T06:00:00Z/2026-11-01T12:30:00+02:00", _utc(2026, 11, 1, 6), _utc(2026, 11, 1, 10, 30)),
    ("2026-11-01T06:00/2026-11-02", _utc(2026, 11, 1, 6), _utc(2026, 11, 2)),
])
def test_periods_are_half_open_utc_intervals(text: str, start: datetime, end: datetime) -> None:
    period = parse_period(text)
    assert (period.start, period.end) == (start, end)
    assert period.label == text
    assert "/" not in period.slug and ":" not in period.slug


@pytest.mark.parametrize("text", ["", "2026-13", "2026-02-30", "last month", "2026-11-02/2026-11-01", "x/2026-11-01"])
def test_bad_periods_raise_a_period_error_with_examples(text: str) -> None:
    with pytest.raises(PeriodError):
        parse_period(text)


@pytest.mark.parametrize("text", ["0999", "0001-01", "0001-01-01/9999-12-31", "1899-12-31", "2300", "9999",
                                  "9999-12", "9999-12-31", "1899-12-31T23:59:59Z/1900-01-02",
                                  "2299-12-31/2300-01-01T00:00:01Z", "0001-01-01T00:00+05:00/2026-01-01"])
def test_periods_outside_clickhouse_datetime64_are_refused_naming_the_range(text: str) -> None:
    with pytest.raises(PeriodError, match=r"period .* 1900-01-01 \.\. 2299-12-31"):
        parse_period(text)


@pytest.mark.parametrize("text,start,end", [
    ("1900", _utc(1900, 1, 1), _utc(1901, 1, 1)),
    ("2299", _utc(2299, 1, 1), _utc(2300, 1, 1)),
    ("2299-12-31", _utc(2299, 12, 31), _utc(2300, 1, 1)),
    ("1900-01-01/2300-01-01", _utc(1900, 1, 1), _utc(2300, 1, 1)),
])
def test_the_edges_of_the_supported_range_parse(text: str, start: datetime, end: datetime) -> None:
    period = parse_period(text)
    assert (period.start, period.end) == (start, end)
