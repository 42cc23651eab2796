"""kvmeter.ledger — exact, idempotent usage metering in ClickHouse; billing and reconciliation.

Where a token is billed: the gateway hands each finished request's
:class:`~kvmeter.events.UsageEvent` to :meth:`Ledger.record`, which returns once the event is
fsynced in the spool (:mod:`.spool`); a writer thread (:mod:`.drain`) inserts it into ClickHouse
exactly once (:mod:`.schema` for the tables); :mod:`.queries` reads it back deduplicated per
period and :mod:`.window_queries` per time bucket (the dashboards' reads), both through
:class:`~.connection.QueryRunner`; :mod:`.billing` prices it with the one price function
(:meth:`.prices.PriceList.cost`) into the invoice (:func:`~.billing.build_invoice`, the one
assembly); :mod:`.reconcile` compares the engine, gateway and ledger views; :mod:`.read_api`
serves it over HTTP and :mod:`.http_client` reads it from another process; :mod:`.cli` is
``kvmeter billing``. Agent runs: :mod:`.agent_records` (tool-call decisions, approval events, run
stops) and :mod:`.agent_runs` (the per-run rollup and its reads). Interference (who filled the
engine steps of requests that missed their objective): :mod:`.step_records` (per-step engine work
→ ``engine_steps``) and :mod:`.interference` (the read).
"""

from .agent_records import ApprovalRecord, RunStopRecord, ToolCallRecord
from .agent_runs import AgentRunQueries
from .config import LedgerConfig
from .errors import (ConfigError, InvalidRecord, LedgerError, LedgerLocked, LedgerUnavailable, MigrationError,
                     PeriodError, PriceListError, SpoolWriteError, UnpricedModel)
from .interference import InterferenceQueries
from .ledger import Ledger
from .period import Period, parse_period
from .prices import PriceList, load_price_list
from .queries import LedgerQueries, UsageReader
from .records import Adjustment, AttemptRecord, SignalSample, attempt_id_for

__all__ = [
    "Ledger",
    "LedgerConfig",
    "LedgerQueries",
    "UsageReader",
    "AttemptRecord",
    "Adjustment",
    "SignalSample",
    "attempt_id_for",
    "ToolCallRecord",
    "ApprovalRecord",
    "RunStopRecord",
    "AgentRunQueries",
    "InterferenceQueries",
    "Period",
    "parse_period",
    "PriceList",
    "load_price_list",
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
