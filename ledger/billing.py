"""Invoices: deduplicated usage × price list, in exact decimals (the lines are a polars frame).

:func:`build_invoice` is the one place an invoice is assembled — ``kvmeter billing report``, the
read API's ``/v1/usage/invoice`` and the dashboards' billing page all call it: it reads the
period's usage, attempts and adjustments through a
:class:`~kvmeter.ledger.queries.UsageReader` and prices them with :func:`invoice_lines`.

One usage line per (period, tenant, workspace, project, API key, model, tier) — the
attribution of :data:`~kvmeter.ledger.queries.INVOICE_KEYS` — plus, beside it, one line per cause of
engine work that reached no client (:data:`~kvmeter.events.UNDELIVERED_CAUSES`), billed
(``line_type`` ``undelivered_billed``, priced like usage) or absorbed by the platform
(``undelivered_absorbed``: its tokens shown, ``subtotal`` and ``cost`` 0, the list price of the work
in ``note``), as the tier's policy and the logical request's other attempts decided
(:data:`~kvmeter.ledger.queries.BILL_CLASSES`), plus one line per adjustment.

Time zones: each tenant is billed in its own zone (its org's ``billing_timezone``; see
:mod:`kvmeter.billing_calendar`). Given the tenants' zones, :func:`build_invoice` reads the period
label once per zone (``2026-11`` in ``America/New_York`` is ``2026-11-01T04:00Z ..
2026-12-01T05:00Z``) and keeps each tenant's rows from its own zone's read; every line carries its
``timezone``, ``period_start`` and ``period_end`` (UTC instants).

Token columns follow the metering rules: ``input_tokens`` are all input tokens, of which
``cached_input_tokens`` were served from the prefix cache (a part, not an addition);
``output_tokens`` are all generated tokens, of which ``reasoning_tokens`` were reasoning.
Money (see :mod:`kvmeter.ledger.prices` for the rule):

* ``subtotal`` — exact: the price function :meth:`~kvmeter.ledger.prices.PriceList.cost` of the
  line's token sums (Σ tokens × unit price), ``Decimal(38, 18)`` in polars.
* ``cost`` — ``subtotal`` rounded once, by the price list's rule (Python ``Decimal.quantize``).
* a tenant's total is the sum of its lines' ``cost``.

KV token-seconds are reported, not priced (a float measure; pricing it would break exactness).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Iterable, Mapping

import polars as pl

from kvmeter.billing_calendar import UTC
from kvmeter.tokens import TOKEN_FIELDS, TokenCounts

from .period import Period
from .prices import PriceList
from .queries import INVOICE_KEYS, UsageReader

__all__ = ["Invoice", "build_invoice", "invoice_lines", "invoice_totals", "INVOICE_COLUMNS", "LINE_TYPES", "MONEY"]

#: polars dtype of exact money and unit prices.
MONEY = pl.Decimal(38, 18)

_USAGE_INTS = ("requests", "aborted_requests", "error_requests", "input_tokens", "cached_input_tokens",
               "output_tokens", "reasoning_tokens")
_ATTEMPT_INTS = ("attempts", "rejected_attempts", "replayed_attempts", "invalid_attempts")

#: Line types of usage, in the order they follow each other for one line key.
LINE_TYPES = ("usage", "undelivered_billed", "undelivered_absorbed")

#: Column order of the invoice line frame (and of the CSV / Parquet files).
INVOICE_COLUMNS = (
    "period", "period_start", "period_end", "timezone", "line_type", "undelivered_cause", *INVOICE_KEYS,
    "requests", "attempts", "rejected_attempts", "replayed_attempts", "invalid_attempts", "aborted_requests",
    "error_requests", "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens", "kv_token_seconds",
    "currency", "price_list_version", "priced", "subtotal", "cost", "note",
)


def _frame(rows: Iterable[dict[str, Any]], ints: tuple[str, ...], extra: dict[str, Any]) -> pl.DataFrame:
    schema: dict[str, Any] = {k: pl.String for k in INVOICE_KEYS}
    schema.update({k: pl.Int64 for k in ints})
    schema.update(extra)
    rows = list(rows)
    if not rows:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema)


def invoice_lines(usage: Iterable[dict[str, Any]], attempts: Iterable[dict[str, Any]],
                  adjustments: Iterable[dict[str, Any]], prices: PriceList, period: Period) -> pl.DataFrame:
    """Build the invoice lines of a period.

    Args:
        usage: rows of :meth:`LedgerQueries.invoice_usage` (deduplicated usage per line key, line
            type and undelivered cause; a row without ``line_type`` — an older server's — is usage).
        attempts: rows of :meth:`LedgerQueries.invoice_attempts` (HTTP attempts per line key).
        adjustments: rows of :meth:`LedgerQueries.adjustments`.
        prices: the price list.
        period: the billed period.
    Returns:
        A frame with :data:`INVOICE_COLUMNS`: per line key its usage line, then its undelivered
        lines (:data:`LINE_TYPES` order, by cause; sorted by key), then adjustment lines. Attempt
        counts are on the usage line. ``priced`` is False (and ``subtotal``/``cost`` null) for a
        model the list does not price, unless the line has no tokens (only refused attempts): that
        costs 0; an absorbed line's ``subtotal`` and ``cost`` are 0.
    """
    keys = list(INVOICE_KEYS)
    rows = [{"line_type": "usage", "undelivered_cause": "", **r} for r in usage]
    u = _frame(rows, _USAGE_INTS, {"line_type": pl.String, "undelivered_cause": pl.String,
                                   "kv_token_seconds": pl.Float64})
    a = _frame(attempts, _ATTEMPT_INTS, {})
    lines = u.filter(pl.col("line_type") == "usage")
    undelivered = u.filter(pl.col("line_type") != "usage").with_columns(
        [pl.lit(0, pl.Int64).alias(c) for c in _ATTEMPT_INTS])
    df = lines.join(a, on=keys, how="full", coalesce=True) if a.height else lines.with_columns(
        [pl.lit(0, pl.Int64).alias(c) for c in _ATTEMPT_INTS])
    df = pl.concat([df.select(undelivered.columns), undelivered], how="vertical")
    df = df.with_columns([pl.col(c).fill_null(0) for c in _USAGE_INTS + _ATTEMPT_INTS]
                         + [pl.col("kv_token_seconds").fill_null(0.0), pl.col("line_type").fill_null("usage"),
                            pl.col("undelivered_cause").fill_null("")])
    order = pl.col("line_type").replace_strict({t: i for i, t in enumerate(LINE_TYPES)}, default=len(LINE_TYPES),
                                               return_dtype=pl.Int64)
    df = df.sort([*keys, order, "undelivered_cause"]) if df.height else df
    # each line's subtotal: the one price function over the line's token sums (exact); an absorbed
    # line's work is the platform's cost: shown at list price in its note, billed 0
    # a line of no tokens (only refused attempts, e.g. of a model the list does not price) costs 0
    # under any list: nothing on it needs a price
    values = [prices.cost_if_priced(model, tier, TokenCounts(*counts)) if any(counts) else Decimal(0)
              for model, tier, *counts in df.select("model", "tier", *TOKEN_FIELDS).iter_rows()]
    absorbed = [t == "undelivered_absorbed" for t in df["line_type"].to_list()]
    subtotals = [Decimal(0) if a and v is not None else v for v, a in zip(values, absorbed, strict=True)]
    notes = []
    kinds = zip(df["line_type"].to_list(), df["undelivered_cause"].to_list(), strict=True)
    for v, a, (t, cause) in zip(values, absorbed, kinds, strict=True):
        if v is None:
            notes.append("model not in price list")
        elif a:
            notes.append(f"undelivered work ({cause or 'unknown cause'}) absorbed by the platform; "
                         f"at list price {prices.round(v)} {prices.currency}")
        elif t == "undelivered_billed":
            notes.append(f"undelivered work ({cause or 'unknown cause'}) billed by the tier's policy")
        else:
            notes.append("")
    df = df.with_columns(pl.Series("subtotal", subtotals, dtype=MONEY))
    places = max(0, -int(prices.quantum.normalize().as_tuple().exponent))
    cost_dtype = pl.Decimal(38, places)
    costs = [prices.round(v) if v is not None else None for v in df["subtotal"].to_list()]
    df = df.with_columns(
        pl.Series("cost", costs, dtype=cost_dtype),
        pl.col("subtotal").is_not_null().alias("priced"),
        pl.Series("note", notes, dtype=pl.String),
    )
    adj_rows = []
    for r in adjustments:
        amount = Decimal(r["amount"])
        adj_rows.append({
            **{k: r.get(k, "") or "" for k in ("tenant_id", "workspace_id", "project_id", "api_key_id")},
            "model": "", "tier": "", "subtotal": amount, "cost": prices.round(amount),
            "note": f"adjustment {r.get('adjustment_id', '')}: {r.get('reason', '')}".strip(),
        })
    meta = [pl.lit(period.label).alias("period"), pl.lit(period.start).alias("period_start"),
            pl.lit(period.end).alias("period_end"), pl.lit(period.timezone).alias("timezone"),
            pl.lit(prices.currency).alias("currency"),
            pl.lit(prices.version).alias("price_list_version")]
    df = df.with_columns(meta)
    if adj_rows:
        adj = pl.DataFrame(adj_rows, schema={**{k: pl.String for k in INVOICE_KEYS}, "subtotal": MONEY,
                                             "cost": cost_dtype, "note": pl.String})
        zeros = [pl.lit(0, pl.Int64).alias(c) for c in ("requests", "attempts", "rejected_attempts",
                                                          "replayed_attempts", "invalid_attempts",
                                                          "aborted_requests", "error_requests",
                                                          "input_tokens", "cached_input_tokens", "output_tokens",
                                                          "reasoning_tokens")]
        adj = adj.with_columns(zeros + meta + [pl.lit(0.0).alias("kv_token_seconds"), pl.lit(True).alias("priced"),
                                               pl.lit("adjustment").alias("line_type"),
                                               pl.lit("").alias("undelivered_cause")])
        df = pl.concat([df.select(INVOICE_COLUMNS), adj.select(INVOICE_COLUMNS)], how="vertical")
    return df.select(INVOICE_COLUMNS)


def invoice_totals(lines: pl.DataFrame) -> pl.DataFrame:
    """Per-tenant totals of an invoice line frame.

    Returns:
        ``tenant_id``, ``requests``, ``attempts``, ``input_tokens``, ``cached_input_tokens``,
        ``output_tokens``, ``reasoning_tokens``, ``kv_token_seconds``, ``unpriced_lines``,
        ``adjustments`` (sum of adjustment lines' cost), ``total`` (sum of every line's rounded
        cost), ``currency``; sorted by tenant.
    """
    if lines.height == 0:
        return pl.DataFrame(schema={"tenant_id": pl.String, "total": lines.schema.get("cost", MONEY)})
    return (lines.group_by("tenant_id").agg(
        pl.col("requests").sum(), pl.col("attempts").sum(), pl.col("input_tokens").sum(),
        pl.col("cached_input_tokens").sum(), pl.col("output_tokens").sum(), pl.col("reasoning_tokens").sum(),
        pl.col("kv_token_seconds").sum(), (~pl.col("priced")).sum().alias("unpriced_lines"),
        pl.col("cost").filter(pl.col("line_type") == "adjustment").sum().alias("adjustments"),
        pl.col("cost").sum().alias("total"), pl.col("currency").first(),
    ).sort("tenant_id"))


@dataclass(frozen=True, slots=True)
class Invoice:
    """The invoice of a period, as :func:`build_invoice` assembles it.

    Attributes:
        period: the billed period as asked (its zone is the caller's).
        prices: the price list the lines were priced with.
        lines: the line frame (:data:`INVOICE_COLUMNS`; see :func:`invoice_lines`).
        periods: zone → the period read in that zone, for every zone a line was read in.
    """

    period: Period
    prices: PriceList
    lines: pl.DataFrame
    periods: Mapping[str, Period] = field(default_factory=dict)

    @property
    def totals(self) -> pl.DataFrame:
        """Per-tenant totals (:func:`invoice_totals`)."""
        return invoice_totals(self.lines)

    @property
    def total(self) -> Decimal:
        """Every line's rounded cost summed (unpriced lines count 0): exact, in the list's currency."""
        return sum((c for c in self.lines["cost"].to_list() if c is not None), Decimal(0)) if self.lines.height \
            else Decimal(0)

    @property
    def unpriced(self) -> pl.DataFrame:
        """The lines whose model the price list does not price (``priced`` false)."""
        return self.lines.filter(~self.lines["priced"]) if self.lines.height else self.lines

    def rows(self) -> list[dict[str, Any]]:
        """The lines as dicts (the read API's JSON rows: money as exact ``Decimal``)."""
        return self.lines.to_dicts()


def build_invoice(reader: UsageReader, period: Period, prices: PriceList, tenant_id: str | None = None,
                  zones: Mapping[str, str] | None = None) -> Invoice:
    """Assemble the invoice of ``period``: the one assembly the CLI, the read API and the
    dashboards share.

    Args:
        reader: where the ledger is read — :class:`~kvmeter.ledger.queries.LedgerQueries`
            (ClickHouse) or :class:`~kvmeter.ledger.http_client.LedgerHttpClient` (a serve
            process's read API).
        period: the billed period.
        prices: the price list (Decimal unit prices; the rounding rule is the list's).
        tenant_id: one tenant, or ``None`` for all.
        zones: tenant id → billing time zone (IANA; tenants not named are UTC). ``None``: every
            line is read in ``period``'s own zone. Given, each tenant's lines cover
            ``period.label`` read in its zone (one read per distinct zone).
    Returns:
        The :class:`Invoice`: one usage line per :data:`~kvmeter.ledger.queries.INVOICE_KEYS`
        plus one line per adjustment, each rounded once.
    Raises:
        whatever the reader raises (``LedgerUnavailable``, ``LedgerError``, ``ValueError``);
        ``PeriodError`` when the label cannot be read in a tenant's zone.
    """
    # zone → (the period read in it, the zone whose tenants' lines to keep; None: every line)
    by_zone: dict[str, tuple[Period, str | None]]
    if zones is None:
        by_zone = {period.timezone: (period, None)}
    elif tenant_id is not None:
        p = period.in_zone(zones.get(tenant_id, UTC))
        by_zone = {p.timezone: (p, None)}
    else:
        names = set(zones.values()) | {UTC}
        by_zone = {z: (period.in_zone(z), z) for z in sorted(names)}
    zone_of: Mapping[str, str] = zones if zones is not None else {}
    frames = []
    for p, keep in by_zone.values():
        def mine(rows: Iterable[dict[str, Any]], keep: str | None = keep) -> list[dict[str, Any]]:
            rows = list(rows)
            if keep is None:
                return rows
            return [r for r in rows if zone_of.get(r.get("tenant_id", ""), UTC) == keep]
        frames.append(invoice_lines(mine(reader.invoice_usage(p, tenant_id)),
                                    mine(reader.invoice_attempts(p, tenant_id)),
                                    mine(reader.adjustments(p, tenant_id)), prices, p))
    lines = frames[0] if len(frames) == 1 else _merge(frames)
    return Invoice(period, prices, lines, {z: p for z, (p, _) in by_zone.items()})


def _merge(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Usage and undelivered lines of every zone sorted by key, then the adjustment lines (as
    :func:`invoice_lines`)."""
    both = pl.concat(frames, how="vertical")
    usage = both.filter(pl.col("line_type") != "adjustment")
    order = pl.col("line_type").replace_strict({t: i for i, t in enumerate(LINE_TYPES)}, default=len(LINE_TYPES),
                                               return_dtype=pl.Int64)
    usage = usage.sort([*INVOICE_KEYS, order, "undelivered_cause"]) if usage.height else usage
    return pl.concat([usage, both.filter(pl.col("line_type") == "adjustment")], how="vertical")
