"""Small rendering helpers shared by the pages (number formatting, notes, chart placement)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import streamlit as st

if TYPE_CHECKING:
    from altair.typing import ChartType  # (altair ≥ 5.4; a type only)

__all__ = ["si", "pct", "secs", "chart", "note_fallback", "empty", "PER_ATTEMPT"]

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))

#: The caption of a page drawn from the ledger's window reads, which count every attempt
#: (:mod:`kvmeter.ledger.window_queries`, "Attempts, not the bill").
PER_ATTEMPT = ("Requests and tokens on this page are counted per attempt — the engine's work: a retried request "
               "once per attempt, attempts nobody was billed for included. What is billed is on the Billing page.")


def si(value: Any, unit: str = "", digits: int = 3) -> str:
    """``value`` with an SI prefix and its unit: ``si(12345, "tokens/s")`` → ``12.3 k tokens/s``;
    ``—`` for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    v = float(value)
    for scale, prefix in _PREFIXES:
        if abs(v) >= scale:
            return f"{v / scale:.{digits}g} {prefix}{unit}".strip()
    text = f"{v:.{digits}g}" if v != int(v) or abs(v) < 1 else f"{int(v):,}"
    return f"{text} {unit}".strip()


def pct(value: Any, digits: int = 1) -> str:
    """A 0–1 ratio as a percentage (``—`` for missing)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{100 * float(value):.{digits}f} %"


def secs(value: Any) -> str:
    """Seconds, in ms below one second (``—`` for missing)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    v = float(value)
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def chart(c: ChartType) -> None:
    """Draw an altair chart across the container (Streamlit's theme)."""
    st.altair_chart(c, width="stretch")


def note_fallback(what: str, signal: str) -> None:
    """Say that a chart shows the ledger-derived estimate because ``signal`` has no samples."""
    st.caption(f"{what}: estimated from the ledger (no `{signal}` samples in this window — the serve "
               "process writes them while its signal recorder runs).")


def empty(what: str) -> None:
    """An info line for a chart with nothing to draw."""
    st.info(f"No {what} in this window.")
