"""How money is written: the one formatting function every printer uses.

The billing CLI's summary line, the HTML reports, the read API's JSON and the dashboards all call
:func:`format_money`; nothing prints ``str()`` of a raw :class:`~decimal.Decimal` (which writes a
zero ``Decimal(38, 18)`` as ``0E-18`` and small amounts as ``1E-7``).

Rule: plain notation, never an exponent; at least the display places (the currency's ISO 4217
minor units, or the price list's rounding quantum when finer); more places only when the exact
value needs them (an unrounded subtotal such as ``0.000356`` is shown whole, never rounded away).
CSV and Parquet keep the frame's own exact decimals (polars writes them in plain notation).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

__all__ = ["format_money", "currency_places", "money_places"]

#: ISO 4217 currencies whose minor unit is not 2 places (the rest have 2).
_MINOR_UNITS = {
    "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "ISK": 0, "JPY": 0, "KMF": 0, "KRW": 0, "PYG": 0, "RWF": 0,
    "UGX": 0, "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0, "XOF": 0, "XPF": 0,
    "BHD": 3, "IQD": 3, "JOD": 3, "KWD": 3, "LYD": 3, "OMR": 3, "TND": 3, "CLF": 4, "UYW": 4,
}


def currency_places(currency: str | None) -> int:
    """The ISO 4217 minor-unit places of ``currency`` (``USD`` 2, ``JPY`` 0, ``KWD`` 3; 2 when unknown)."""
    return _MINOR_UNITS.get((currency or "").upper(), 2)


def _exponent_places(d: Decimal) -> int:
    exponent = d.normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def money_places(prices: Any) -> int:
    """Display places of a price list's amounts: the currency's minor units, or the places of its
    rounding quantum when finer (a list rounding to ``0.0001`` shows 4)."""
    return max(currency_places(getattr(prices, "currency", None)), _exponent_places(prices.quantum))


def format_money(amount: Decimal | int | str, places: int | None = 2, *, grouping: bool = False) -> str:
    """Write an exact amount in plain notation.

    Args:
        amount: a :class:`~decimal.Decimal` (an ``int`` or a decimal string is read exactly;
            a ``float`` is refused: money is never a float).
        places: the display places (see :func:`money_places`); the result has at least this many
            and more only when the exact value needs them (the read API's JSON, the HTML and
            the CLI all pass the price list's :func:`money_places`). ``None``: the amount's own
            scale (``Decimal("0E-8")`` → ``0.00000000``).
        grouping: thousands separators (``1,234.50``), for people; off for machine text.
    Returns:
        e.g. ``0.00`` for ``Decimal("0E-18")``, ``0.000356`` for ``Decimal("0.000356000")``,
        ``-12.30``; ``NaN``/``Infinity`` are refused.
    Raises:
        TypeError: a float or another type. ValueError: a non-finite Decimal or negative places.
    """
    if isinstance(amount, bool) or isinstance(amount, float):
        raise TypeError(f"money must be a Decimal, not {type(amount).__name__}")
    if isinstance(amount, (int, str)):
        amount = Decimal(amount)
    if not isinstance(amount, Decimal):
        raise TypeError(f"money must be a Decimal, not {type(amount).__name__}")
    if not amount.is_finite():
        raise ValueError(f"money must be finite, got {amount}")
    if places is None:
        text = format(amount, ",f" if grouping else "f")
    else:
        if places < 0:
            raise ValueError(f"places must be >= 0, got {places}")
        shown = max(places, _exponent_places(amount))
        text = format(amount.quantize(Decimal(1).scaleb(-shown)), ",f" if grouping else "f")
    return "0" + text[2:] if text.startswith("-0") and Decimal(text) == 0 else text  # no "-0.00"
