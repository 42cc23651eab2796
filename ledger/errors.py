"""The ledger's exceptions: one base class, outside errors translated where they enter.

ClickHouse (clickhouse-connect, chDB) and OS errors are mapped to these at the boundary
(:mod:`kvmeter.ledger.connection`, :mod:`kvmeter.ledger.spool`), so callers such as the gateway
catch ``LedgerError`` and never a driver's class.
"""

from __future__ import annotations

__all__ = [
    "LedgerError",
    "InvalidRecord",
    "LedgerUnavailable",
    "LedgerLocked",
    "SpoolWriteError",
    "MigrationError",
    "PeriodError",
    "PriceListError",
    "UnpricedModel",
    "ConfigError",
]


class LedgerError(Exception):
    """Base of every error the ledger raises."""


class InvalidRecord(LedgerError, ValueError):
    """A usage event / attempt / signal that cannot be stored (bad type, range or id).

    Raised by ``Ledger.record*`` *before* anything is written, so one bad record never poisons
    the spool. The message names the field and the offending value.
    """


class LedgerUnavailable(LedgerError):
    """ClickHouse cannot be reached or refused the operation for a reason outside the data.

    Writes are unaffected (they are durable in the spool and drain later); reads raise this.
    """


class LedgerLocked(LedgerError):
    """The spool directory or the embedded chDB path is held by another process.

    chDB on disk is single-process (docs/ARCHITECTURE.md, "Facts measured on the build
    machine"): while ``kvmeter serve`` owns the embedded ledger, other processes read it through
    the serve process's read API (``--server URL --api-key KEY``).
    """


class SpoolWriteError(LedgerError):
    """The spool could not make a record durable (disk full, I/O error). The caller's request
    must not be reported as billed-and-durable."""


class MigrationError(LedgerError):
    """A schema migration failed, or an applied migration's file changed since (checksum)."""


class PeriodError(LedgerError, ValueError):
    """A billing period string that does not parse (see :func:`kvmeter.ledger.period.parse_period`)."""


class PriceListError(LedgerError, ValueError):
    """A price list file that does not validate (unknown key, non-decimal price, bad discount)."""


class UnpricedModel(LedgerError, KeyError):
    """:meth:`~kvmeter.ledger.prices.PriceList.cost` of a model the price list does not price
    (the quota answers it with 400 ``unpriced_model``; billing marks the line ``priced`` false).

    Attributes:
        model: the model name.
    """

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} has no price in the price list")
        self.model = model

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class ConfigError(LedgerError, ValueError):
    """An invalid :class:`~kvmeter.ledger.config.LedgerConfig` value (DSN, sizes, intervals)."""
