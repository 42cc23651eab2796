"""Money in the quota store: integer nano-units of the pricing currency.

Prices and limits are :class:`~decimal.Decimal` everywhere in Python. The stores count money as
integers of 10⁻⁹ currency units, so the Redis Lua script can compare and add it exactly (Redis
``INCRBY`` is exact int64 arithmetic; the script compares the decimal strings, never doubles).
Amounts are converted with ROUND_CEILING: the quota counter never under-counts spend, and over-counts
by less than one nano-unit per request. This is quota (protection), not billing; the ledger bills
the exact Decimal amounts.

Range: 0 ≤ amount ≤ 9·10⁹ currency units (int64 holds 9.2·10¹⁸ nano-units).
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation

__all__ = ["NANO", "to_units", "from_units"]

#: One store unit of money.
NANO = Decimal("0.000000001")


def to_units(amount: Decimal) -> int:
    """Decimal money → integer nano-units, rounded up.

    Raises:
        TypeError: ``amount`` is not a Decimal (floats are refused: money is never binary).
        ValueError: negative, NaN or infinite.
    """
    if not isinstance(amount, Decimal):
        raise TypeError(f"money must be a Decimal, got {type(amount).__name__}")
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"money must be a finite Decimal >= 0, got {amount}")
    try:
        return int((amount / NANO).to_integral_value(rounding=ROUND_CEILING))
    except InvalidOperation as e:  # pragma: no cover — finite inputs always quantize
        raise ValueError(f"cannot convert {amount} to nano-units") from e


def from_units(units: int) -> Decimal:
    """Integer nano-units → Decimal currency (exact)."""
    return Decimal(int(units)) * NANO
