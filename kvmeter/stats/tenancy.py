"""Stats of the tenant directory: each attempt to reload the principals config."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConfigReloaded"]


@dataclass(slots=True)
class ConfigReloaded:
    """A reload of the tenancy config was attempted.

    Attributes:
        ok: True if the new config is live.
        version: the live snapshot's version after the attempt.
        error: the :class:`ConfigError` message when ``ok`` is false (never contains key material).
        keys: API keys in the live snapshot.
        wall_ts: wall-clock epoch seconds.
    """

    ok: bool
    version: int
    error: str = ""
    keys: int = 0
    wall_ts: float = 0.0
