"""Dashboard settings: explicit argument > environment variable > default (the configuration
order of docs/ARCHITECTURE.md, "Conventions").

Two data modes, exactly one per process:

* **server** (mode *a*) — ``--server URL`` / ``KVMETER_DASHBOARD_SERVER``: read through a running
  ``kvmeter serve``'s read API. Required for the embedded chDB ledger while serve holds it.
* **dsn** (mode *b*) — ``--ledger-dsn DSN`` / ``KVMETER_LEDGER_DSN`` (the ledger's own variable),
  default ``chdb://./var/ledger/chdb``: query ClickHouse directly — a server, or a chDB path no
  process holds. API keys are then checked against the tenancy file (``--tenants`` /
  ``KVMETER_TENANTS``, default the packaged demo tenants), which also gives the tier SLOs.

Environment variables:

==============================  ==============================================  ===============
variable                        meaning                                         default
==============================  ==============================================  ===============
KVMETER_DASHBOARD_SERVER        serve process URL (mode *a*)                    unset
KVMETER_LEDGER_DSN              ClickHouse DSN (mode *b*)                       chdb://./var/ledger/chdb
KVMETER_DASHBOARD_API_KEY       key signed in at start (else the sign-in form)  unset
KVMETER_TENANTS                 tenancy YAML (mode *b*: keys and tier SLOs)     demo tenants
KVMETER_PRICES                  price list YAML (mode *b*: invoice lines)       packaged list
KVMETER_DASHBOARD_REFRESH_S     auto-refresh period, seconds (0 = off)          30
KVMETER_DASHBOARD_CACHE_TTL_S   query cache lifetime, seconds                   30
KVMETER_DASHBOARD_RANGE         initial time range (see ``window.RANGES``)     last 1 h
KVMETER_DASHBOARD_UNTIL         pin the window's end (ISO 8601), e.g. to        unset (now)
                                review an incident or take reproducible shots
==============================  ==============================================  ===============
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from kvmeter.ledger.config import DSN_ENV, parse_dsn
from kvmeter.ledger.errors import ConfigError as LedgerConfigError

from .errors import ConfigError
from .window import RANGES, utc

__all__ = ["DashboardConfig", "ENV"]

#: field → environment variable.
ENV: dict[str, str] = {
    "server_url": "KVMETER_DASHBOARD_SERVER",
    "ledger_dsn": DSN_ENV,
    "api_key": "KVMETER_DASHBOARD_API_KEY",
    "tenants_path": "KVMETER_TENANTS",
    "prices_path": "KVMETER_PRICES",
    "refresh_s": "KVMETER_DASHBOARD_REFRESH_S",
    "cache_ttl_s": "KVMETER_DASHBOARD_CACHE_TTL_S",
    "default_range": "KVMETER_DASHBOARD_RANGE",
    "until": "KVMETER_DASHBOARD_UNTIL",
}


def _default_dsn() -> str:
    return "chdb://" + os.path.abspath("var/ledger/chdb")


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    """Validated dashboard settings.

    Attributes:
        server_url: serve process URL (mode *a*), or ``None``.
        ledger_dsn: ClickHouse DSN (mode *b*); ignored in mode *a*.
        api_key: a key to sign in with at start (never shown), or ``None`` for the sign-in form.
        tenants_path: tenancy YAML for mode *b* (``None``: the packaged demo tenants).
        prices_path: price list for mode *b* (``None``: the packaged list).
        refresh_s: seconds between automatic refreshes of the charts (0 = off; else ≥ 5).
        cache_ttl_s: seconds a query result is reused (≥ 1).
        default_range: one of :data:`~kvmeter.dashboards.window.RANGES`.
        until: the window's fixed end (UTC), or ``None`` for "now".
    Raises:
        ConfigError: both a server URL and a DSN given explicitly, a bad URL or DSN, or a number
            out of range.
    """

    server_url: str | None = None
    ledger_dsn: str = field(default_factory=_default_dsn)
    api_key: str | None = field(default=None, repr=False)
    tenants_path: Path | None = None
    prices_path: Path | None = None
    refresh_s: float = 30.0
    cache_ttl_s: float = 30.0
    default_range: str = "last 1 h"
    until: datetime | None = None

    def __post_init__(self) -> None:
        if self.server_url is not None and not self.server_url.startswith(("http://", "https://")):
            raise ConfigError(f"server URL must be http(s)://host:port, got {self.server_url!r}")
        if self.server_url is None:
            try:
                parse_dsn(self.ledger_dsn)
            except LedgerConfigError as exc:
                raise ConfigError(str(exc)) from None
        if not (self.refresh_s == 0 or self.refresh_s >= 5):
            raise ConfigError(f"refresh_s must be 0 (off) or >= 5 seconds, got {self.refresh_s}")
        if not self.cache_ttl_s >= 1:
            raise ConfigError(f"cache_ttl_s must be >= 1 second, got {self.cache_ttl_s}")
        if self.default_range not in RANGES:
            raise ConfigError(f"default_range must be one of {list(RANGES)}, got {self.default_range!r}")
        if self.until is not None:
            object.__setattr__(self, "until", utc(self.until))

    @property
    def mode(self) -> str:
        """``server`` (through the read API) or ``dsn`` (ClickHouse directly)."""
        return "server" if self.server_url else "dsn"

    @property
    def target(self) -> str:
        """Where the data comes from, without secrets (for the sidebar and logs)."""
        if self.server_url:
            return self.server_url
        return parse_dsn(self.ledger_dsn).redacted()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> "DashboardConfig":
        """Explicit values (``None`` = not given) win, then the environment, then defaults.

        An explicit ``server_url`` together with an explicit ``ledger_dsn`` is an error; a DSN
        from the environment is simply unused in server mode.

        Raises:
            ConfigError: invalid or conflicting values, unknown fields.
        """
        env = os.environ if env is None else env
        unknown = set(explicit) - set(ENV)
        if unknown:
            raise ConfigError(f"unknown dashboard setting(s): {sorted(unknown)}")
        if explicit.get("server_url") and explicit.get("ledger_dsn"):
            raise ConfigError("give either --server (read through kvmeter serve) or --ledger-dsn, not both")
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            value = explicit.get(name)
            if value is None and env.get(var):
                value = env[var]
            if value is None:
                continue
            try:
                if name in ("refresh_s", "cache_ttl_s"):
                    value = float(value)
                elif name in ("tenants_path", "prices_path"):
                    value = Path(value).expanduser()
                elif name == "until" and isinstance(value, str):
                    value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise ConfigError(f"{name} ({var}): cannot read {value!r}") from None
            values[name] = value
        return cls(**values)

    def with_api_key(self, api_key: str | None) -> "DashboardConfig":
        """A copy with another start-up key."""
        return replace(self, api_key=api_key)
