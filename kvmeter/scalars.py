"""Numbers out of polars reductions, typed.

polars types ``Series.max()``, ``min()``, ``mean()`` and ``median()`` as any Python literal (a date,
a string, bytes, a list, ...) or ``None``, because a column's dtype is not known statically.
:func:`number` reads the reduction of a numeric column as a float and checks at run time what the
type checker cannot. This module imports nothing from kvmeter.
"""

from __future__ import annotations

from decimal import Decimal

__all__ = ["number"]


def number(value: object) -> float | None:
    """``value`` (an ``int``, ``float`` or ``Decimal``; ``bool`` counts as an int) as a float, or
    ``None`` for ``None`` (the reduction of an empty or all-null column).

    Raises:
        TypeError: any other type (the reduction of a non-numeric column).
    """
    if value is None:
        return None
    if isinstance(value, (int, float, Decimal)):
        return float(value)
    raise TypeError(f"expected a number, got {type(value).__name__} {value!r}")
