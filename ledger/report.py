"""Writing billing and reconciliation reports: CSV, Parquet and a readable HTML page.

CSV and Parquet carry the full frame (Decimal money stays exact: Parquet ``decimal(38, s)``,
CSV decimal text in plain notation). The HTML page (Jinja2, autoescaped) shows the metadata, the
per-tenant summary and the detail table, laid out for a person reading it in a browser: each
label beside its value, tables no wider than the page (at most 1,200 px: long identifiers wrap,
after ``_ - / . : @`` first, numbers never do), numbers right-aligned in tabular figures, money written by
:func:`kvmeter.money.format_money` (never ``0E-18``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from decimal import Decimal

import polars as pl
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from kvmeter.money import format_money

__all__ = ["HtmlSection", "write_report", "FORMATS"]

FORMATS = ("csv", "parquet", "html")


@dataclass(frozen=True, slots=True)
class HtmlSection:
    """One table of the HTML page.

    Attributes:
        title: heading.
        frame: the rows.
        note: a paragraph under the heading.
        bad_column, bad_values: rows whose ``bad_column`` value is in ``bad_values`` are highlighted.
    """

    title: str
    frame: pl.DataFrame
    note: str = ""
    bad_column: str | None = None
    bad_values: tuple[Any, ...] = field(default_factory=tuple)


#: Where an identifier may break across lines on the page: after these characters (``paid_|interactive``,
#: ``SmolLM2-|135M-|Instruct``), so a wide table narrows its text columns instead of its page overflowing.
_BREAK_AFTER = re.compile(r"([_\-/.:@])")


def _breakable(value: Any) -> Markup:
    """``value`` HTML-escaped, with a ``<wbr>`` (a line-break opportunity) after each of :data:`_BREAK_AFTER`."""
    return Markup(_BREAK_AFTER.sub(r"\1<wbr>", str(escape(value))))


def _env() -> Environment:
    env = Environment(loader=PackageLoader("kvmeter.ledger", "templates"),
                      autoescape=select_autoescape(["html", "jinja"]), keep_trailing_newline=True)
    env.filters["breakable"] = _breakable
    return env


def _display(value: Any, money_places: int = 2) -> Any:
    if isinstance(value, Decimal):
        return format_money(value, money_places, grouping=True)
    if isinstance(value, float):
        return f"{value:,.6g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return value


def write_report(out_dir: str | Path, basename: str, frame: pl.DataFrame, *, title: str,
                 meta: Mapping[str, Any], sections: Sequence[HtmlSection],
                 formats: Sequence[str] = FORMATS, headline: str = "", headline_ok: bool = True,
                 money_places: int = 2) -> list[Path]:
    """Write ``frame`` as ``<basename>.csv`` / ``.parquet`` and an HTML page of ``sections``.

    Args:
        out_dir: directory (created if missing).
        basename: file name without extension.
        frame: the detail rows (CSV/Parquet).
        title, meta: HTML heading and key/value metadata (period, price list, rounding rule...).
        sections: HTML tables.
        formats: subset of :data:`FORMATS`.
        headline, headline_ok: a status sentence shown at the top of the page.
        money_places: display places of Decimal amounts on the HTML page
            (:func:`kvmeter.money.money_places`; more only where the exact value needs them).
    Returns:
        The paths written.
    Raises:
        ValueError: on an unknown format. OSError: if the files cannot be written.
    """
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"unknown report format(s) {sorted(unknown)}; choose from {FORMATS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "csv" in formats:
        path = out / f"{basename}.csv"
        frame.write_csv(path)
        written.append(path)
    if "parquet" in formats:
        path = out / f"{basename}.parquet"
        frame.write_parquet(path)
        written.append(path)
    if "html" in formats:
        rendered = []
        for s in sections:
            rows = [{k: _display(v, money_places) for k, v in row.items()} for row in s.frame.iter_rows(named=True)]
            text_cols = {c for c, t in s.frame.schema.items() if t in (pl.String, pl.Boolean) or t == pl.Datetime}
            rendered.append({"title": s.title, "note": s.note, "columns": s.frame.columns, "rows": rows,
                             "headers": {c: c.replace("_", " ") for c in s.frame.columns},
                             "text_columns": text_cols, "wrap_columns": {"note", "reason", "status_note"},
                             "bad_column": s.bad_column,
                             "bad_values": [_display(v, money_places) for v in s.bad_values]})
        html = _env().get_template("report.html.jinja").render(
            title=title, meta=dict(meta), sections=rendered, headline=headline,
            headline_class="status-ok" if headline_ok else "status-fail")
        path = out / f"{basename}.html"
        path.write_text(html, encoding="utf-8")
        written.append(path)
    return written
