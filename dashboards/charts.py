"""Altair chart builders: every axis says its unit, every time axis is UTC over the window.

Builders take polars frames (altair reads them through narwhals) and return ``alt.Chart`` /
layered charts; they never fetch data and never call Streamlit.
"""

from __future__ import annotations

from typing import Final, Sequence

import altair as alt
import polars as pl

from .window import Window

__all__ = ["timeseries", "bars", "grouped_bars", "scatter", "heatmap", "histogram", "with_rules",
           "percentiles_vs_slo", "series_vs_slo", "layer",
           "TIER_ORDER", "PALETTE"]

#: Tiers from most to least protected (legend order).
TIER_ORDER = ["enterprise", "paid_interactive", "batch", "free"]
#: One fixed colour per tier, on every page.
TIER_COLORS = {"enterprise": "#4c78a8", "paid_interactive": "#f58518", "batch": "#54a24b", "free": "#e45756"}
#: Colour scheme of categorical series (20 distinct colours: top-10 tenants + "(other)" fit).
PALETTE: Final = "tableau20"


def _x_time(window: Window) -> alt.X:
    fmt = "%H:%M:%S" if window.span_s <= 900 else ("%H:%M" if window.span_s <= 86400 else "%b %d %H:%M")
    return alt.X("ts:T", title="time (UTC)",
                 scale=alt.Scale(type="utc", domain=[window.start.isoformat(), window.end.isoformat()]),
                 axis=alt.Axis(format=fmt, labelAngle=0, tickCount=6, grid=False))


def _color(field: str, title: str, domain: Sequence[str] | None = None) -> alt.Color:
    if field == "tier":  # tiers keep one colour on every page
        known = list(domain) if domain else list(TIER_COLORS)
        scale = alt.Scale(domain=known, range=[TIER_COLORS.get(t, "#9d755d") for t in known])
        return alt.Color("tier:N", title=title, scale=scale, legend=alt.Legend(orient="right"))
    scale = alt.Scale(scheme=PALETTE, domain=list(domain)) if domain else alt.Scale(scheme=PALETTE)
    # (a bottom legend with columns breaks Streamlit's chart sizing: legends stay on the right)
    return alt.Color(f"{field}:N", title=title, scale=scale, legend=alt.Legend(orient="right", labelLimit=180))


def timeseries(df: pl.DataFrame, y: str, *, title: str, y_title: str, window: Window,
               color: str | None = None, color_title: str | None = None, mark: str = "line",
               y_format: str = "~s", height: int = 260, color_domain: Sequence[str] | None = None,
               tooltip_format: str = ",.3~f", y_scale: alt.Scale | None = None) -> alt.Chart:
    """A time series over the window.

    Heights are the chart's *total* height (Streamlit fits title, axes and legend inside it);
    keep ``y_title`` short (≲ 25 characters): a rotated axis title taller than the plot pushes
    the chart's title out of its frame.

    Args:
        df: rows with ``ts`` (UTC bucket start), ``y`` and optionally ``color``.
        y: the value column; ``y_title`` names it with its unit (``tokens / s``).
        mark: ``line``, ``area`` (stacked by ``color``) or ``bar``.
        y_format: d3 format of the axis labels (``~s`` = SI: 1.2k, 3M; ``.0%`` for ratios).
    """
    enc_y = alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(format=y_format),
                  stack="zero" if mark in ("area", "bar") else None,
                  scale=y_scale if y_scale is not None else alt.Undefined)
    tooltip = [alt.Tooltip("ts:T", title="bucket start (UTC)", format="%Y-%m-%d %H:%M:%S",
                          timeUnit="utcyearmonthdatehoursminutesseconds"),
               alt.Tooltip(f"{y}:Q", title=y_title, format=tooltip_format)]
    base = alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14), height=height)
    if mark == "area":
        chart = base.mark_area(opacity=0.8, interpolate="step-after", line=False)
    elif mark == "bar":
        chart = base.mark_bar()
    else:
        chart = base.mark_line(interpolate="linear", strokeWidth=1.8)
    enc = {"x": _x_time(window), "y": enc_y, "tooltip": tooltip}
    if color:
        enc["color"] = _color(color, color_title or color, color_domain)
        tooltip.insert(1, alt.Tooltip(f"{color}:N", title=color_title or color))
    return chart.encode(**enc)


def layer(*charts: alt.Chart) -> alt.LayerChart:
    """Layer charts under the first one's title and height (a title inside a layer is not drawn
    properly by Streamlit's vega renderer)."""
    first = charts[0].copy()
    title, height = first.title, first.height
    first.title = alt.Undefined
    first.height = alt.Undefined
    # (alt.layer would return a FacetChart for layers sharing facet encodings; these have none)
    return alt.LayerChart(layer=[first, *charts[1:]], title=title, height=height)


def with_rules(chart: alt.Chart, rules: pl.DataFrame, *, y: str = "value", label: str = "label",
               color: str = "#d62728") -> alt.LayerChart:
    """Overlay horizontal reference lines (SLOs, thresholds): ``rules`` has ``y`` and ``label``."""
    base = alt.Chart(rules)
    rule = base.mark_rule(strokeDash=[6, 4], color=color, strokeWidth=1.5).encode(
        y=f"{y}:Q", tooltip=[alt.Tooltip(f"{label}:N", title="reference"), alt.Tooltip(f"{y}:Q", format=",.3~f")])
    text = base.mark_text(align="left", dx=4, dy=-6, color=color, fontSize=11).encode(
        y=f"{y}:Q", x=alt.value(0), text=f"{label}:N")
    return layer(chart, rule, text)


def bars(df: pl.DataFrame, category: str, value: str, *, title: str, value_title: str,
         category_title: str, color: str | None = None, color_title: str | None = None,
         value_format: str = "~s", height: int | None = None, sort_desc: bool = True,
         color_domain: Sequence[str] | None = None) -> alt.Chart:
    """Horizontal bars, one per category, longest first; stacked by ``color`` if given."""
    n = df.select(pl.col(category).n_unique()).item() if df.height else 1
    n_colors = df.select(pl.col(color).n_unique()).item() if (color and df.height) else 0
    tooltip = [alt.Tooltip(f"{category}:N", title=category_title),
               alt.Tooltip(f"{value}:Q", title=value_title, format=",.4~f")]
    enc = {
        "y": alt.Y(f"{category}:N", title=category_title, sort="-x" if sort_desc else None),
        "x": alt.X(f"{value}:Q", title=value_title, axis=alt.Axis(format=value_format)),
        "tooltip": tooltip,
    }
    if color:
        enc["color"] = _color(color, color_title or color, color_domain)
        tooltip.append(alt.Tooltip(f"{color}:N", title=color_title or color))
    # total height: ~28 px per bar plus title and axis, and room for the legend
    auto = max(170, 34 * n + 110, 22 * n_colors + 80)
    return alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14),
                     height=height or auto).mark_bar().encode(**enc)


def grouped_bars(df: pl.DataFrame, category: str, group: str, value: str, *, title: str,
                 value_title: str, category_title: str, group_title: str, value_format: str = "~s",
                 height: int = 280) -> alt.Chart:
    """Vertical bars grouped by ``category`` with one bar per ``group`` (xOffset)."""
    return alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14), height=height).mark_bar().encode(
        x=alt.X(f"{category}:N", title=category_title, axis=alt.Axis(labelAngle=-20)),
        xOffset=alt.XOffset(f"{group}:N"),
        y=alt.Y(f"{value}:Q", title=value_title, axis=alt.Axis(format=value_format)),
        color=_color(group, group_title),
        tooltip=[alt.Tooltip(f"{category}:N", title=category_title), alt.Tooltip(f"{group}:N", title=group_title),
                 alt.Tooltip(f"{value}:Q", title=value_title, format=",.4~f")],
    )


def scatter(df: pl.DataFrame, x: str, y: str, *, title: str, x_title: str, y_title: str, size: str,
            size_title: str, color: str, color_title: str, label: str, height: int = 380,
            labelled: int = 8) -> alt.LayerChart:
    """Log–log scatter (who sends requests vs who carries the tokens); the ``labelled`` points
    with the largest ``y`` carry their label. ``x`` and ``y`` must be > 0."""
    base = alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14), height=height)
    points = base.mark_circle(opacity=0.75, stroke="white", strokeWidth=0.5).encode(
        x=alt.X(f"{x}:Q", title=x_title, scale=alt.Scale(type="log"), axis=alt.Axis(format="~s")),
        y=alt.Y(f"{y}:Q", title=y_title, scale=alt.Scale(type="log"), axis=alt.Axis(format="~s")),
        size=alt.Size(f"{size}:Q", title=size_title, scale=alt.Scale(range=[40, 1600]), legend=alt.Legend(format="~s")),
        color=_color(color, color_title),
        tooltip=[alt.Tooltip(f"{label}:N"), alt.Tooltip(f"{x}:Q", title=x_title, format=","),
                 alt.Tooltip(f"{y}:Q", title=y_title, format=","),
                 alt.Tooltip(f"{size}:Q", title=size_title, format=",.4~s")],
    )
    top = df.sort(y, descending=True).head(labelled)
    text = alt.Chart(top).mark_text(align="left", dx=8, dy=-4, fontSize=11).encode(
        x=alt.X(f"{x}:Q", scale=alt.Scale(type="log")), y=alt.Y(f"{y}:Q", scale=alt.Scale(type="log")),
        text=f"{label}:N")
    return layer(points, text)


def heatmap(df: pl.DataFrame, x: str, y: str, value: str, *, title: str, x_title: str, y_title: str,
            value_title: str, height: int | None = None) -> alt.LayerChart:
    """A count heatmap (``value`` per ``x`` × ``y``) with the counts written in the cells."""
    ny = df.select(pl.col(y).n_unique()).item() if df.height else 1
    cells = alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14),
                      height=height or max(220, 34 * ny + 140)).mark_rect().encode(
        x=alt.X(f"{x}:N", title=x_title, axis=alt.Axis(labelAngle=0, labelLimit=160)),
        y=alt.Y(f"{y}:N", title=y_title),
        color=alt.Color(f"{value}:Q", title=value_title, scale=alt.Scale(scheme="orangered")),
        tooltip=[alt.Tooltip(f"{x}:N", title=x_title), alt.Tooltip(f"{y}:N", title=y_title),
                 alt.Tooltip(f"{value}:Q", title=value_title, format=",")],
    )
    text = alt.Chart(df).mark_text(fontSize=11).encode(x=f"{x}:N", y=f"{y}:N",
                                                      text=alt.Text(f"{value}:Q", format=",~s"))
    return layer(cells, text)


def histogram(df: pl.DataFrame, bin_label: str, value: str, *, title: str, x_title: str, y_title: str,
              order: Sequence[str], height: int = 260) -> alt.Chart:
    """Pre-binned counts as columns, bins in ``order``."""
    return alt.Chart(df, title=alt.Title(title, anchor="start", fontSize=14), height=height).mark_bar().encode(
        x=alt.X(f"{bin_label}:N", title=x_title, sort=list(order), axis=alt.Axis(labelAngle=0)),
        y=alt.Y(f"{value}:Q", title=y_title, axis=alt.Axis(format="~s")),
        tooltip=[alt.Tooltip(f"{bin_label}:N", title=x_title), alt.Tooltip(f"{value}:Q", title=y_title, format=",")],
    )


def percentiles_vs_slo(df: pl.DataFrame, slos: pl.DataFrame, *, title: str, y_title: str,
                       height: int = 280) -> alt.LayerChart:
    """Latency percentiles per tier as dots (p50 → p99 on one stem) with each tier's SLO as a red
    tick, on a log axis (tiers' promises span milliseconds to minutes). Values must be > 0.

    Args:
        df: ``tier``, ``percentile`` (p50, p95, p99), ``value`` (seconds).
        slos: ``tier``, ``slo`` (seconds; tiers without an SLO left out).
    """
    x = alt.X("tier:N", title="tier", sort=TIER_ORDER, axis=alt.Axis(labelAngle=-30, labelOverlap=False))
    y_scale = alt.Scale(type="log")
    stem = alt.Chart(df).mark_rule(color="#bbbbbb", strokeWidth=2).encode(
        x=x, y=alt.Y("min(value):Q", scale=y_scale), y2="max(value):Q")
    dots = alt.Chart(df).mark_point(filled=True, size=110, opacity=0.95).encode(
        x=x,
        y=alt.Y("value:Q", title=y_title, scale=y_scale, axis=alt.Axis(format="~s")),
        color=alt.Color("percentile:N", title="percentile", sort=["p50", "p95", "p99"],
                        scale=alt.Scale(domain=["p50", "p95", "p99"], range=["#9ecae1", "#3182bd", "#08306b"])),
        tooltip=[alt.Tooltip("tier:N"), alt.Tooltip("percentile:N"), alt.Tooltip("value:Q", title=y_title,
                                                                                 format=",.3~f")],
    )
    ticks = alt.Chart(slos).mark_tick(color="#d62728", thickness=3, size=40).encode(
        x=alt.X("tier:N", sort=TIER_ORDER), y=alt.Y("slo:Q", scale=y_scale),
        tooltip=[alt.Tooltip("tier:N"), alt.Tooltip("slo:Q", title="SLO (s)", format=",.3~f")])
    return alt.LayerChart(layer=[stem, dots, ticks], title=alt.Title(title, anchor="start", fontSize=14), height=height)


def series_vs_slo(df: pl.DataFrame, slos: pl.DataFrame, y: str, *, title: str, y_title: str,
                  window: Window, height: int = 280) -> alt.LayerChart:
    """One line per tier over time, with each tier's SLO as a dashed line of the same colour, on a
    log axis (values must be > 0).

    Args:
        df: ``ts``, ``tier``, ``y`` (seconds).
        slos: ``tier``, ``slo`` (seconds).
    """
    tiers = sorted(set(df.get_column("tier").to_list()) | set(slos.get_column("tier").to_list()),
                   key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else 99, t))
    line = timeseries(df, y, title=title, y_title=y_title, window=window, color="tier", color_title="tier",
                      y_format="~s", height=height, color_domain=tiers, y_scale=alt.Scale(type="log"))
    rules = alt.Chart(slos).mark_rule(strokeDash=[6, 4], strokeWidth=1.5).encode(
        y="slo:Q", color=alt.Color("tier:N", scale=alt.Scale(domain=tiers, range=[TIER_COLORS.get(t, "#9d755d")
                                                                                   for t in tiers]), legend=None),
        tooltip=[alt.Tooltip("tier:N"), alt.Tooltip("slo:Q", title="SLO (s)", format=",.3~f")])
    return layer(line, rules)
