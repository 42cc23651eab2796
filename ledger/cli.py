"""``kvmeter billing`` — invoice reports, three-way reconciliation and ledger maintenance.

Examples::

    kvmeter billing report --period 2026-11                  # CSV + Parquet + HTML in ./billing
    kvmeter billing report --period 2026-11-29 --tenant acme --prices my-prices.yaml
    kvmeter billing reconcile --period 2026-11-01/2026-11-15 --max-drift-ratio 0.001
    kvmeter billing report --period 2026-11 --server http://127.0.0.1:8000 --api-key $KEY
    kvmeter billing report --period 2026-11 --ledger-dsn chdb:///srv/kvmeter/ledger
    kvmeter billing migrate
    kvmeter billing prices --prices my-prices.yaml           # validate and print a price list

Where the data comes from: ``--server URL`` reads through a running serve process's read API
(needed while ``kvmeter serve`` owns the embedded chDB ledger) and prices with that server's price
list and its tenants' billing time zones unless ``--prices`` is given; otherwise the ledger DSN
(``--ledger-dsn``, alias ``--dsn`` > ``KVMETER_LEDGER_DSN`` > ``chdb://./var/ledger/chdb``). For an
embedded ledger ``report`` and ``reconcile`` only read: a chDB path that does not hold a kvmeter
ledger is refused (exit 2), never created. They open it, drain its spool first when the spool
directory exists (progress lines on stderr), then read. ``migrate`` creates what is missing.
On the ledger path the tenants' billing time zones come from the tenants config (``--tenants``,
default ``$KVMETER_TENANTS``; without one every tenant is billed in UTC): each tenant's lines
cover the period read in its zone (:mod:`kvmeter.billing_calendar`).

Exit status: 0 ok; 1 reconciliation found a view outside its bound (the engine view's unexplained
drift ratio above ``--max-drift-ratio``, or the gateway view's admitted attempts without a finish
above ``--max-missing-finishes``), each printed as one ``drift: TENANT: VIEW ...`` line on stderr
saying by how much; 2 bad arguments or configuration, or a ledger path that holds no ledger;
3 the report has usage the price list does not price; 4 the ledger is unavailable or held by
another process.

Output: report paths on stdout; progress, the summary line and errors on stderr, each error one
``error: ...`` line. An embedded ledger held by another process is that one line (naming
``--server URL --api-key KEY``), never chDB's own ``Cannot lock file`` text; library INFO logs
show only with ``kvmeter -v`` (see :mod:`kvmeter.cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from datetime import datetime, timezone
from decimal import InvalidOperation
from typing import TYPE_CHECKING, Any, Iterator

from .billing import build_invoice
from .config import LedgerConfig, require_existing_ledger
from .errors import LedgerError, LedgerLocked, LedgerUnavailable
from .period import Period, parse_period
from kvmeter.money import format_money, money_places
from .prices import PriceList, load_price_list
from .queries import UsageReader
from .reconcile import reconcile

if TYPE_CHECKING:
    import polars as pl
from .report import FORMATS, HtmlSection, write_report

__all__ = ["add_arguments", "run", "drift_lines"]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_DRIFT, EXIT_USAGE, EXIT_UNPRICED, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4

#: Invoice-line columns the HTML page shows (the CSV and Parquet files carry all of INVOICE_COLUMNS).
HTML_LINE_COLUMNS = ("line_type", "tenant_id", "workspace_id", "project_id", "api_key_id", "model", "tier",
                     "requests", "attempts", "input_tokens", "cached_input_tokens", "output_tokens",
                     "reasoning_tokens", "subtotal", "cost", "note")


def _dsn_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    # --ledger-dsn is the name serve and dashboard use; --dsn stays as an alias
    p.add_argument("--ledger-dsn", "--dsn", dest="dsn", metavar="DSN", help=help_text)


def _source_args(p: argparse.ArgumentParser) -> None:
    _dsn_arg(p, "ledger DSN (chdb://PATH of an existing ledger, or http(s)://user:pass@host:port/db); "
                "default $KVMETER_LEDGER_DSN or chdb://./var/ledger/chdb; --dsn is an alias")
    p.add_argument("--spool-dir", help="spool directory (embedded ledger); default $KVMETER_SPOOL_DIR")
    p.add_argument("--server", help="read through a running serve process instead, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("KVMETER_API_KEY"),
                   help="API key for --server (default $KVMETER_API_KEY); a tenant key sees its own tenant")
    p.add_argument("--tenant", help="only this tenant")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``report``, ``reconcile``, ``migrate`` and ``prices`` under ``kvmeter billing``."""
    sub = parser.add_subparsers(dest="billing_command", metavar="ACTION")
    period_help = ("2026-11 (month), 2026-11-29 (day), 2026 (year) or START/END in ISO 8601 (UTC, end exclusive), "
                   "within 1900-01-01 .. 2299-12-31")

    p = sub.add_parser("report", help="invoice lines per org/workspace/project/key: CSV, Parquet, HTML")
    p.add_argument("--period", required=True, help=period_help + "; read in each tenant's billing time zone")
    p.add_argument("--prices", help="price list YAML (default: the server's with --server, else the packaged "
                                    "prices.yaml)")
    p.add_argument("--tenants", default=os.environ.get("KVMETER_TENANTS"),
                   help="tenants config whose orgs' billing_timezone the periods follow (ledger path; default "
                        "$KVMETER_TENANTS; none: UTC). With --server the server's zones are used")
    p.add_argument("--out", default="billing", help="output directory (default ./billing)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of csv,parquet,html")
    _source_args(p)

    p = sub.add_parser("reconcile", help="engine vs gateway vs ledger per tenant: CSV, Parquet, HTML")
    p.add_argument("--period", required=True, help=period_help)
    p.add_argument("--out", default="billing", help="output directory (default ./billing)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of csv,parquet,html")
    p.add_argument("--max-drift-ratio", type=float, default=0.0,
                   help="fail (exit 1) when a tenant's unexplained drift ratio exceeds this (default 0)")
    p.add_argument("--max-missing-finishes", type=int, default=None,
                   help="also fail when a tenant has more admitted requests without any finish than this")
    p.add_argument("--prices", help=argparse.SUPPRESS)
    _source_args(p)

    p = sub.add_parser("migrate", help="create or upgrade the ledger schema")
    _dsn_arg(p, "ledger DSN, created if missing (default $KVMETER_LEDGER_DSN or chdb://./var/ledger/chdb); "
                "--dsn is an alias")

    p = sub.add_parser("prices", help="validate a price list and print it")
    p.add_argument("--prices", help="price list YAML (default: the packaged prices.yaml)")


def _drain(ledger) -> None:  # noqa: ANN001 — a Ledger
    stats = ledger.stats()
    if stats.spool_depth_events == 0 and stats.spool_pending_events == 0:
        return
    print(f"ledger: draining {stats.spool_depth_events:,} spooled records into ClickHouse...", file=sys.stderr)
    for _ in range(120):
        if ledger.flush(timeout_s=5.0):
            print("ledger: spool drained", file=sys.stderr)
            return
        stats = ledger.stats()
        print(f"ledger: {stats.spool_depth_events:,} records left ({stats.last_error or 'working'})", file=sys.stderr)
        if not stats.clickhouse_up and stats.last_error:
            raise LedgerUnavailable(f"cannot drain the spool: {stats.last_error}")
    raise LedgerUnavailable("the spool did not drain within 10 minutes")


@contextlib.contextmanager
def _chdb_stderr_held() -> Iterator[None]:
    """Hold what is written to file descriptor 2 while the embedded engine opens.

    chDB prints its own errors straight to descriptor 2 (C++, past ``sys.stderr``) before the
    Python exception arrives — for a path another process holds, ``Code: 76. DB::Exception: Cannot
    lock file .../status ...``. When the open fails with :class:`LedgerLocked`, the one ``error:``
    line this command prints says it all, so the held text is dropped; otherwise (success or any
    other error) it is written out afterwards, unchanged.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        locked = False
        try:
            yield
        except LedgerLocked:
            locked = True
            raise
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()  # Python's own lines written meanwhile go to the held file too
            os.dup2(saved, 2)
            os.close(saved)
            if not locked:
                held.seek(0)
                text = held.read()
                if text:
                    os.write(2, text)


@contextlib.contextmanager
def _reader(args: argparse.Namespace, prices: PriceList) -> Iterator[tuple[UsageReader, str]]:
    if args.server:
        from .http_client import LedgerHttpClient
        if not args.api_key:
            raise ValueError("--server needs --api-key (or $KVMETER_API_KEY)")
        if not args.server.startswith(("http://", "https://")):
            raise ValueError(f"--server must be an http(s):// URL, got {args.server!r}")
        with LedgerHttpClient(args.server, args.api_key) as client:
            yield client, f"read API {args.server}"
        return
    config = LedgerConfig.from_env(dsn=args.dsn, spool_dir=args.spool_dir)
    require_existing_ledger(config.parsed_dsn, config.effective_database)  # read-only: never create
    if config.embedded and config.spool_dir.is_dir():
        from .ledger import Ledger
        with _chdb_stderr_held():
            ledger = Ledger.open(config, prices=prices)
        try:
            _drain(ledger)
            yield ledger.queries, config.parsed_dsn.redacted()
        finally:
            ledger.close()
        return
    # a server, or an embedded ledger without a spool directory (nothing to drain; opening the
    # Ledger would create one)
    from .connection import ClientHolder, connect
    from .queries import LedgerQueries
    from .schema import migrate
    holder = ClientHolder(lambda: connect(config), lambda c: migrate(c, config.cluster))
    try:
        if config.embedded:  # open it now, its chDB output held (the first query would open it)
            with _chdb_stderr_held():
                holder.get()
        yield LedgerQueries(holder, prices), config.parsed_dsn.redacted()
    finally:
        holder.close()


def _formats(text: str) -> tuple[str, ...]:
    formats = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = set(formats) - set(FORMATS)
    if unknown or not formats:
        raise ValueError(f"--formats takes a comma list of {','.join(FORMATS)}, got {text!r}")
    return formats


def _meta(period: Period, source: str) -> dict[str, str]:
    zone_note = "UTC" if period.timezone == "UTC" else f"{period.timezone}, as UTC instants"
    return {"period": period.label,
            f"interval ({zone_note}, end exclusive)": f"{period.start.isoformat()} .. {period.end.isoformat()}",
            "source": source, "generated at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _local_zones(path: str | None) -> dict[str, str] | None:
    """Tenant → billing time zone from a tenants config file (``None`` without one)."""
    if not path:
        return None
    from kvmeter.serving.tenancy import ConfigError, load_config
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return {oid: org.billing_timezone for oid, org in cfg.orgs.items()}


def _report(args: argparse.Namespace) -> int:
    period = parse_period(args.period)
    formats = _formats(args.formats)
    prices = load_price_list(args.prices)
    with _reader(args, prices) as (reader, source):
        zones = _local_zones(args.tenants)
        if args.server:
            server_prices, zones = reader.billing_config()  # type: ignore[attr-defined]
            if args.prices is None:
                if server_prices is None:
                    raise ValueError(f"{args.server} has no price list; give --prices")
                prices = server_prices
        if args.tenant is not None and zones is not None:
            period = period.in_zone(zones.get(args.tenant, "UTC"))
        invoice = build_invoice(reader, period, prices, args.tenant, zones)
    lines, totals, unpriced = invoice.lines, invoice.totals, invoice.unpriced
    shown_zones = sorted(invoice.periods)
    meta = _meta(period, source) | {
        "time zones": ", ".join(shown_zones) + ("" if zones else " (no tenants config: UTC)"),
        "currency": prices.currency, "price list": f"{prices.version} ({prices.source})",
        "rounding": prices.rounding_rule,
        "token types": "input ⊇ cached input; output ⊇ reasoning (parts are not additions)",
        "invoice lines": f"{lines.height:,}"}
    headline = (f"{unpriced.height} line(s) use models the price list does not price: "
                f"{sorted(set(unpriced['model'].to_list()))}" if unpriced.height else "")
    # the page shows what finance reads (the files keep every column): the line's attribution,
    # requests, billed tokens and money (org_id is the tenant; attempt and outcome breakdowns,
    # KV token-seconds and the period columns are in the CSV / Parquet)
    shown = [c for c in HTML_LINE_COLUMNS if c in lines.columns]
    paths = write_report(args.out, f"billing-{period.slug}", lines, title=f"kvmeter invoice lines — {period.label}",
                         meta=meta, formats=formats, headline=headline, headline_ok=not unpriced.height,
                         sections=[HtmlSection("Totals per tenant", totals,
                                               note="total = sum of the lines' rounded costs (adjustments included)"),
                                   HtmlSection("Invoice lines", lines.select(shown),
                                               note="subtotal is exact; cost is rounded once per line.",
                                               bad_column="note", bad_values=("model not in price list",))],
                         money_places=money_places(prices))
    for path in paths:
        print(path)
    print(f"{lines.height} invoice lines, {totals.height} tenants, "
          f"total {format_money(invoice.total, money_places(prices))} {prices.currency}", file=sys.stderr)
    if unpriced.height:
        print(f"error: {headline}", file=sys.stderr)
        return EXIT_UNPRICED
    return EXIT_OK


def _reconcile(args: argparse.Namespace) -> int:
    period = parse_period(args.period)
    formats = _formats(args.formats)
    prices = load_price_list(args.prices)
    with _reader(args, prices) as (reader, source):
        views = reader.reconcile_views(period, args.tenant)
    result = reconcile(views, threshold_ratio=args.max_drift_ratio, max_missing_finishes=args.max_missing_finishes)
    frame = result.frame
    headline = (f"unexplained drift above {args.max_drift_ratio:g} for: {', '.join(result.failed_tenants)}"
                if result.failed else f"{frame.height} tenant(s): no unexplained drift above {args.max_drift_ratio:g}")
    views_cols = ["tenant_id", "status", "engine_requests", "engine_tokens", "gateway_attempts", "gateway_admitted",
                  "rejected_attempts", "replayed_attempts", "ledger_requests", "ledger_tokens"]
    explained = ["tenant_id", "matched_requests", "aborted_requests", "aborted_tokens", "frontend_only_requests",
                 "frontend_only_tokens", "superseded_requests", "superseded_tokens", "duplicate_rows"]
    unexplained = ["tenant_id", "status", "mismatched_requests", "matched_token_drift", "ledger_only_requests",
                   "ledger_only_tokens", "engine_unbilled_requests", "engine_unbilled_tokens",
                   "duplicate_billed_requests", "duplicate_billed_tokens", "missing_finishes",
                   "missing_finish_reserved_tokens", "unexplained_drift_tokens", "unexplained_drift_ratio"]
    reservation = ["tenant_id", "reserved_tokens", "actual_tokens", "reservation_drift_tokens",
                   "reservation_drift_ratio"]
    engine_work = ["tenant_id", "engine_tokens", "delivered_engine_tokens", "undelivered_billed_engine_tokens",
                   "undelivered_absorbed_engine_tokens", "superseded_engine_tokens", "explained_engine_tokens",
                   "engine_tokens_explained_ratio"]
    paths = write_report(
        args.out, f"reconcile-{period.slug}", frame, title=f"kvmeter reconciliation — {period.label}",
        meta=_meta(period, source) | {"drift threshold (ratio)": f"{args.max_drift_ratio:g}"},
        formats=formats, headline=headline, headline_ok=not result.failed,
        sections=[
            HtmlSection("The three views", frame.select(views_cols), bad_column="status", bad_values=("drift",),
                        note="engine = the engine's own per-request counters (hooks); gateway = HTTP attempts; "
                             "ledger = deduplicated usage events. Tokens = input + output."),
            HtmlSection("Explained differences", frame.select(explained),
                        note="aborted: aborts without an engine record (an engine without hooks), billed from "
                             "the frontend's counts; superseded: engine work of an attempt whose logical request was "
                             "billed under a later attempt; duplicate_rows: stored duplicates that billing's FINAL "
                             "read removes."),
            HtmlSection("Where the engine's tokens went", frame.select(engine_work),
                        note="each attempt's engine work by the bill class of its usage row: delivered (the "
                             "logical request's bill), undelivered and billed (the tier's policy; default: the "
                             "client abandoned it), undelivered and absorbed by the platform (server failure, "
                             "shutdown, deadline, or a failed attempt of a request that succeeded), superseded "
                             "(a second success; engine work with no row of its own). explained = their sum."),
            HtmlSection("Unexplained drift", frame.select(unexplained), bad_column="status", bad_values=("drift",),
                        note="missing finishes are admitted attempts with neither an engine record nor a usage "
                             "event: lost, or still running at the end of the period."),
            HtmlSection("Reservation vs actual (quota quality, not billing drift)", frame.select(reservation)),
        ])
    for path in paths:
        print(path)
    print(headline, file=sys.stderr)
    for line in drift_lines(frame, args.max_drift_ratio, args.max_missing_finishes):
        print(line, file=sys.stderr)
    return EXIT_DRIFT if result.failed else EXIT_OK


def _n(value: Any, unit: str) -> str:
    """``1 token``, ``1,400 tokens`` (``value``: a whole number)."""
    count = int(value)
    return f"{count:,} {unit}{'' if count == 1 else 's'}"


def drift_lines(frame: "pl.DataFrame", max_drift_ratio: float, max_missing_finishes: int | None) -> list[str]:
    """One ``drift:`` line per tenant and view that is outside its bound, saying by how much.

    Args:
        frame: :attr:`ReconcileReport.frame <kvmeter.ledger.reconcile.ReconcileReport.frame>`.
        max_drift_ratio: the engine view's bound (``unexplained_drift_ratio``, ≥ 0).
        max_missing_finishes: the gateway view's bound (admitted attempts with neither an engine
            record nor a usage event), or ``None``: not bounded.
    Returns:
        ``drift: <tenant>: engine view vs ledger: ...`` (the unexplained tokens, the work seen, the
        ratio and its bound, then each kind of difference that is not zero) and ``drift: <tenant>:
        gateway view vs ledger: ...`` lines; empty when every view is within its bound.
    """
    lines: list[str] = []
    for row in frame.iter_rows(named=True):
        ratio = float(row["unexplained_drift_ratio"])
        if ratio > max_drift_ratio:
            seen = int(row["ledger_tokens"]) + int(row["engine_unbilled_tokens"])
            parts = [f"{label} {_n(row[req], 'request')} / {_n(row[tok], 'token')}" for label, req, tok in (
                ("mismatched", "mismatched_requests", "matched_token_drift"),
                ("ledger-only", "ledger_only_requests", "ledger_only_tokens"),
                ("engine work never billed", "engine_unbilled_requests", "engine_unbilled_tokens"),
                ("billed twice", "duplicate_billed_requests", "duplicate_billed_tokens")) if row[req] or row[tok]]
            lines.append(f"drift: {row['tenant_id']}: engine view vs ledger: "
                         f"{_n(row['unexplained_drift_tokens'], 'token')} unexplained of {seen:,} "
                         f"(ratio {ratio:.6g} > bound {max_drift_ratio:g}): {'; '.join(parts)}")
        missing = int(row["missing_finishes"])
        if max_missing_finishes is not None and missing > max_missing_finishes:
            lines.append(f"drift: {row['tenant_id']}: gateway view vs ledger: "
                         f"{_n(missing, 'admitted attempt')} with no engine record and no usage event of "
                         f"{int(row['gateway_admitted']):,} admitted (bound {max_missing_finishes}; "
                         f"{_n(row['missing_finish_reserved_tokens'], 'reserved token')})")
    return lines


def _migrate(args: argparse.Namespace) -> int:
    from .connection import connect
    from .schema import migrate
    config = LedgerConfig.from_env(dsn=args.dsn)
    client = connect(config)
    try:
        done = migrate(client, config.cluster)
    finally:
        client.close()
    print(f"ledger schema at {config.parsed_dsn.redacted()}: "
          f"{'applied ' + ', '.join(map(str, done)) if done else 'already current'}")
    return EXIT_OK


def _prices(args: argparse.Namespace) -> int:
    prices = load_price_list(args.prices)
    print(f"price list {prices.version} ({prices.source}), {prices.currency}, {prices.rounding_rule}")
    for model, price in sorted(prices.models.items()):
        print(f"  {model}: input {price.input}, cached_input {price.cached_input}, output {price.output}, "
              f"reasoning {price.reasoning} per 1M tokens")
    for tier, discount in sorted(prices.tier_discounts.items()):
        print(f"  tier {tier}: discount {discount}")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Run ``kvmeter billing ACTION``; returns the exit status (see the module docstring)."""
    actions = {"report": _report, "reconcile": _reconcile, "migrate": _migrate, "prices": _prices}
    action = actions.get(getattr(args, "billing_command", None) or "")
    if action is None:
        print("usage: kvmeter billing {report,reconcile,migrate,prices} ... (see --help)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return action(args)
    except LedgerLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except LedgerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (LedgerError, ValueError, InvalidOperation) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.ArgumentParser().parse_args()))
