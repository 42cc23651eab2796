"""Opening the configured data mode and signing a key in: the only place that builds sources.

A :class:`Backend` lives once per dashboard process (Streamlit ``cache_resource``); each browser
session signs its key in with :meth:`Backend.sign_in` and gets a :class:`Session` whose
``source`` is a :class:`~kvmeter.dashboards.source.ScopedSource` — the pages never see an
unscoped source.

* server mode: the key is checked by the serve process (``/v1/usage/dash/whoami``); the session
  holds its own :class:`~kvmeter.dashboards.http_source.HttpSource` (the key travels in its headers).
* dsn mode: one :class:`~kvmeter.dashboards.sql.SqlSource` per process (chDB allows one holder
  per path, and one client per process is enough); the key is checked against the tenancy file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field

from kvmeter.ledger.config import CLUSTER_ENV, LedgerConfig
from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.ledger.errors import LedgerUnavailable
from kvmeter.ledger.prices import load_price_list
from kvmeter.serving.tenancy import DEMO_TENANTS_FILE, AuthError, TenantDirectory

from .config import DashboardConfig
from .errors import SignInError
from .http_source import HttpSource
from .source import ScopedSource
from .sql import SqlSource
from .viewer import Viewer, tiers_of

__all__ = ["Backend", "Session"]

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One signed-in key.

    Attributes:
        viewer: who signed in.
        source: every read, scoped to ``viewer``.
        key_id: a digest of the key (cache partition; never the key).
    """

    viewer: Viewer
    source: ScopedSource
    key_id: str
    _http: HttpSource | None = field(default=None, repr=False)

    def close(self) -> None:
        """Release the session's HTTP pool (server mode)."""
        if self._http is not None:
            self._http.close()


class Backend:
    """The configured data mode.

    Args:
        config: the dashboard settings.
    Raises:
        ConfigError (tenancy), PriceListError: invalid tenancy or price file (dsn mode), at
            construction.
    """

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._sql: SqlSource | None = None
        self._directory: TenantDirectory | None = None
        if config.mode == "dsn":
            self._directory = TenantDirectory.from_file(config.tenants_path or DEMO_TENANTS_FILE)
            self._prices = load_price_list(config.prices_path)

    @property
    def mode(self) -> str:
        return self.config.mode

    def _sql_source(self) -> SqlSource:
        with self._lock:
            if self._sql is None:
                # cluster mode (KVMETER_LEDGER_CLUSTER) only changes how the interference read is
                # rendered (GLOBAL IN/JOIN over the Distributed tables); a read-only client never
                # runs DDL
                ledger_config = LedgerConfig(dsn=self.config.ledger_dsn, cluster=os.environ.get(CLUSTER_ENV) or None)
                directory = self._directory
                assert directory is not None
                self._sql = SqlSource(ClientHolder(lambda: _open_read_only(ledger_config)), self._prices,
                                      tiers=lambda: tiers_of(directory), cluster=ledger_config.cluster is not None)
            return self._sql

    def sign_in(self, api_key: str) -> Session:
        """Check ``api_key`` and open a scoped session for it.

        Raises:
            SignInError: a missing or unknown key (the message never contains it).
            LedgerUnavailable: server mode and the serve process cannot be reached.
            LedgerLocked: dsn mode on a chDB path another process holds.
        """
        if not api_key:
            raise SignInError("enter an API key")
        key_id = hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        if self.config.mode == "server":
            assert self.config.server_url is not None
            http = HttpSource(self.config.server_url, api_key)
            try:
                viewer = http.whoami()
            except BaseException:
                http.close()
                raise
            return Session(viewer, ScopedSource(http, viewer), key_id, _http=http)
        assert self._directory is not None
        try:
            principal = self._directory.authenticate(api_key)
        except AuthError as exc:
            raise SignInError(exc.message) from None
        viewer = Viewer.from_principal(principal)
        return Session(viewer, ScopedSource(self._sql_source(), viewer), key_id)

    def close(self) -> None:
        """Close the process-wide ClickHouse client (dsn mode); idempotent."""
        with self._lock:
            sql, self._sql = self._sql, None
        if sql is not None:
            sql.close()


def _open_read_only(config: LedgerConfig):
    """A client on the ledger database, refused unless the ledger's tables are there.

    (``connect`` creates an empty database if the DSN names a new one; the dashboards then stop
    here instead of drawing empty pages.)

    Raises:
        LedgerUnavailable: the database or its ``usage_events`` table does not exist (nothing
            was ever recorded there, or the DSN points elsewhere).
        LedgerLocked: the chDB path is held by another process.
    """
    client = connect(config)
    found = client.query("SELECT count() FROM system.tables WHERE database = currentDatabase() "
                         "AND name IN ('usage_events', 'attempts', 'signals')").result_rows[0][0]
    if found < 3:
        client.close()
        raise LedgerUnavailable(f"no kvmeter ledger at {config.parsed_dsn.redacted()} (tables missing); "
                                "point --ledger-dsn at a ledger kvmeter serve has written, or use --server")
    return client
