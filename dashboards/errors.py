"""The dashboards' exceptions: one base, outside errors translated where they enter.

Ledger errors (:class:`~kvmeter.ledger.errors.LedgerError`) pass through unchanged — they already
say what went wrong (unavailable, locked, refused).
"""

from __future__ import annotations

__all__ = ["DashboardError", "ScopeError", "SignInError", "ConfigError"]


class DashboardError(Exception):
    """Base of every error the dashboards raise."""


class ScopeError(DashboardError, PermissionError):
    """A tenant key asked for another tenant's data (HTTP 403 on the read API)."""


class SignInError(DashboardError):
    """A missing or unknown API key (HTTP 401 on the read API). Never contains the key."""


class ConfigError(DashboardError, ValueError):
    """An invalid dashboard setting (both or neither of server URL and DSN, bad number...)."""
