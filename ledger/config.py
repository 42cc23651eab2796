"""Typed ledger configuration: explicit argument > environment variable > default.

Environment variables (read only by :meth:`LedgerConfig.from_env`):

* ``KVMETER_LEDGER_DSN`` — where ClickHouse is:

  - ``chdb:///abs/path`` or ``chdb://rel/path`` — the embedded engine (chDB) on that directory,
    the default being ``chdb://./var/ledger/chdb``. chDB on disk is single-process: the process
    that opens it (normally ``kvmeter serve``) owns it until it closes it.
  - ``http://user:pass@host:8123/db`` or ``https://...:8443/db`` — a ClickHouse server (or a
    cluster's load balancer); the path names the database (default ``kvmeter``).
* ``KVMETER_SPOOL_DIR`` — the durable spool (WAL) directory, default ``./var/ledger/spool``.
* ``KVMETER_LEDGER_CLUSTER`` — a ClickHouse cluster name: switches the DDL to
  ``Replicated*MergeTree`` + ``ON CLUSTER`` + ``Distributed`` tables (see ``migrations/README.md``).
  Off by default; it has no meaning for chDB.
* ``KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS`` — days of ``engine_steps`` rows kept (default 7,
  ``0`` = forever; :mod:`kvmeter.ledger.retention`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping
from urllib.parse import unquote, urlsplit

from .errors import ConfigError
from .retention import DEFAULT_ENGINE_STEPS_RETENTION_DAYS

__all__ = ["LedgerConfig", "ParsedDsn", "parse_dsn", "require_existing_ledger", "DSN_ENV", "SPOOL_ENV",
           "CLUSTER_ENV", "RETENTION_ENV"]

DSN_ENV = "KVMETER_LEDGER_DSN"
SPOOL_ENV = "KVMETER_SPOOL_DIR"
CLUSTER_ENV = "KVMETER_LEDGER_CLUSTER"
RETENTION_ENV = "KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS"

DEFAULT_CHDB_DIR = "var/ledger/chdb"
DEFAULT_SPOOL_DIR = "var/ledger/spool"
DEFAULT_DATABASE = "kvmeter"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True, slots=True)
class ParsedDsn:
    """A DSN taken apart.

    Attributes:
        kind: ``chdb`` (embedded) or ``http`` (a server; ``secure`` for https).
        path: absolute chDB data directory (``chdb`` only).
        host, port, username, password, secure: server connection (``http`` only).
        database: database named in the DSN path, or ``None``.
    """

    kind: Literal["chdb", "http"]
    path: str = ""
    host: str = ""
    port: int = 0
    username: str = "default"
    password: str = ""
    secure: bool = False
    database: str | None = None

    def redacted(self) -> str:
        """The DSN without its password, for logs and error messages."""
        if self.kind == "chdb":
            return f"chdb://{self.path}"
        scheme = "https" if self.secure else "http"
        db = f"/{self.database}" if self.database else ""
        return f"{scheme}://{self.username}@{self.host}:{self.port}{db}"


def parse_dsn(dsn: str) -> ParsedDsn:
    """Parse a ledger DSN (``chdb://PATH`` or ``http(s)://user:pass@host:port/db``).

    Raises:
        ConfigError: on any other scheme, a missing host, or a database name that is not a
            plain identifier.
    """
    if not isinstance(dsn, str) or not dsn.strip():
        raise ConfigError("ledger DSN must be a non-empty string")
    dsn = dsn.strip()
    if dsn.startswith("chdb:"):
        rest = dsn[len("chdb:"):]
        if rest.startswith("//"):
            rest = rest[2:]
        if not rest or rest.startswith(":memory:"):
            raise ConfigError(f"chDB DSN needs a data directory (got {dsn!r}); the ledger must be durable")
        return ParsedDsn(kind="chdb", path=os.path.abspath(rest))
    parts = urlsplit(dsn)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"ledger DSN scheme must be chdb, http or https, got {parts.scheme or dsn!r}")
    if not parts.hostname:
        raise ConfigError(f"ledger DSN {dsn.split('@')[-1]!r} has no host")
    database = parts.path.strip("/") or None
    if database is not None and not _IDENT.match(database):
        raise ConfigError(f"ledger DSN database {database!r} is not a plain identifier")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"ledger DSN has an invalid port: {exc}") from None
    secure = parts.scheme == "https"
    return ParsedDsn(
        kind="http",
        host=parts.hostname,
        port=port or (8443 if secure else 8123),
        username=unquote(parts.username) if parts.username else "default",
        password=unquote(parts.password) if parts.password else "",
        secure=secure,
        database=database,
    )


def require_existing_ledger(dsn: ParsedDsn, database: str = DEFAULT_DATABASE) -> None:
    """For commands that only read: refuse a chDB path that holds no kvmeter ledger.

    Opening a chDB path creates it (directory, database, schema), so a mistyped path would read
    as an empty ledger. A kvmeter ledger is a directory with ``metadata/<database>/
    schema_migrations.sql`` (written by the first migration). Server DSNs are not checked here
    (the server answers for itself). Touches nothing on disk.

    Raises:
        ConfigError: the path does not exist, is not a directory, or is not a kvmeter ledger;
            the message names the path and what to do.
    """
    if dsn.kind != "chdb":
        return
    path = Path(dsn.path)
    where = f"ledger DSN chdb://{path}"
    if not path.exists():
        raise ConfigError(f"{where}: no such directory (read-only commands do not create a ledger; "
                          "give the path `kvmeter serve --ledger-dsn` writes, or --server URL)")
    if not path.is_dir():
        raise ConfigError(f"{where}: not a directory")
    if not (path / "metadata" / database / "schema_migrations.sql").is_file():
        raise ConfigError(f"{where}: not a kvmeter ledger (no database {database!r} with a schema in it)")


def _default_dsn() -> str:
    return "chdb://" + os.path.abspath(DEFAULT_CHDB_DIR)


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """Everything the ledger needs, validated at construction.

    Attributes:
        dsn: ``chdb://PATH`` (embedded, the default ``chdb://<cwd>/var/ledger/chdb``) or
            ``http(s)://user:pass@host:port/db``. Never logged with its password.
        spool_dir: the WAL directory; one process holds it at a time (a lock file).
        database: database when the DSN names none (default ``kvmeter``).
        batch_size: most records per ClickHouse insert (1–1,000,000; default 200,000).
        flush_interval_s: how often the background writer drains when not asked to (seconds, > 0).
        segment_bytes: spool segment size before rotation (≥ 1 MiB; default 64 MiB).
        cluster: ClickHouse cluster name for the Replicated/Distributed DDL, or ``None`` (default).
        retry_initial_s, retry_max_s: exponential back-off between insert attempts while
            ClickHouse is unreachable (seconds; doubled per failure, capped).
        rollup_interval_s: how often the writer refreshes the hourly rollups (seconds).
        late_after_s: an event whose ``finish_ts`` is older than this when recorded counts as
            ``late`` in :class:`~kvmeter.stats.LedgerStats` (seconds).
        close_timeout_s: how long :meth:`Ledger.close` tries to drain before leaving the rest in
            the spool for the next start (seconds).
        connect_timeout_s, query_timeout_s: HTTP timeouts towards a ClickHouse server (seconds).
        signal_buffer: signal samples held in memory while ClickHouse is away (oldest dropped).
        prices_path: price list file; ``None`` uses the packaged ``prices.yaml``.
        fsync: ``False`` skips fsync in the spool — only for benchmarks that measure its cost.
        engine_steps_retention_days: days of ``engine_steps`` rows kept (int ≥ 0, default 7; 0 =
            keep forever): the table's TTL, applied when the ledger opens
            (:mod:`kvmeter.ledger.retention`).
    Raises:
        ConfigError: on an invalid DSN or an out-of-range number.
    """

    dsn: str = field(default_factory=_default_dsn)
    spool_dir: Path = field(default_factory=lambda: Path(os.path.abspath(DEFAULT_SPOOL_DIR)))
    database: str = DEFAULT_DATABASE
    batch_size: int = 200_000
    flush_interval_s: float = 1.0
    segment_bytes: int = 64 * 1024 * 1024
    cluster: str | None = None
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    rollup_interval_s: float = 60.0
    late_after_s: float = 3600.0
    close_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    query_timeout_s: float = 60.0
    signal_buffer: int = 100_000
    prices_path: Path | None = None
    fsync: bool = True
    engine_steps_retention_days: int = DEFAULT_ENGINE_STEPS_RETENTION_DAYS

    def __post_init__(self) -> None:
        parsed = parse_dsn(self.dsn)  # raises ConfigError
        object.__setattr__(self, "spool_dir", Path(os.path.abspath(os.fspath(self.spool_dir))))
        if self.prices_path is not None:
            object.__setattr__(self, "prices_path", Path(self.prices_path))
        if not _IDENT.match(self.database):
            raise ConfigError(f"database {self.database!r} is not a plain identifier")
        if self.cluster is not None:
            if not _IDENT.match(self.cluster):
                raise ConfigError(f"cluster {self.cluster!r} is not a plain identifier")
            if parsed.kind == "chdb":
                raise ConfigError("cluster mode needs a ClickHouse server DSN, not chdb://")
        if not (isinstance(self.batch_size, int) and 1 <= self.batch_size <= 1_000_000):
            raise ConfigError(f"batch_size must be an int in 1..1,000,000, got {self.batch_size!r}")
        if not (isinstance(self.segment_bytes, int) and self.segment_bytes >= 1024 * 1024):
            raise ConfigError(f"segment_bytes must be >= 1 MiB, got {self.segment_bytes!r}")
        days = self.engine_steps_retention_days
        if not isinstance(days, int) or isinstance(days, bool) or days < 0:
            raise ConfigError(f"engine_steps_retention_days must be an int >= 0 (0 = keep forever), got {days!r}")
        if self.signal_buffer < 1:
            raise ConfigError(f"signal_buffer must be >= 1, got {self.signal_buffer!r}")
        for name in ("flush_interval_s", "retry_initial_s", "retry_max_s", "rollup_interval_s",
                     "late_after_s", "connect_timeout_s", "query_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s must be >= 0, got {self.close_timeout_s!r}")
        if self.retry_max_s < self.retry_initial_s:
            raise ConfigError("retry_max_s must be >= retry_initial_s")

    @property
    def parsed_dsn(self) -> ParsedDsn:
        """The DSN taken apart (see :func:`parse_dsn`)."""
        return parse_dsn(self.dsn)

    @property
    def effective_database(self) -> str:
        """The database the DSN names, else :attr:`database`."""
        return self.parsed_dsn.database or self.database

    @property
    def embedded(self) -> bool:
        """True for a chDB DSN (single-process, owned by the opening process)."""
        return self.parsed_dsn.kind == "chdb"

    def __repr__(self) -> str:  # never show the password
        return (f"LedgerConfig(dsn={self.parsed_dsn.redacted()!r}, spool_dir={str(self.spool_dir)!r}, "
                f"database={self.effective_database!r}, batch_size={self.batch_size}, "
                f"flush_interval_s={self.flush_interval_s}, cluster={self.cluster!r})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, dsn: str | None = None,
                 spool_dir: str | os.PathLike[str] | None = None, cluster: str | None = None,
                 **explicit: object) -> "LedgerConfig":
        """Build a config: each explicit argument wins, then the env var, then the default.

        Args:
            env: environment mapping (default ``os.environ``).
            dsn, spool_dir, cluster: explicit values (``None`` = not given).
            **explicit: any other :class:`LedgerConfig` field.
        Raises:
            ConfigError: on unknown fields or invalid values.
        """
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(explicit) - names
        if unknown:
            raise ConfigError(f"unknown LedgerConfig field(s): {sorted(unknown)}")
        kwargs: dict[str, object] = {k: v for k, v in explicit.items() if v is not None}
        chosen_dsn = dsn or env.get(DSN_ENV)
        if chosen_dsn:
            kwargs["dsn"] = chosen_dsn
        chosen_spool = spool_dir or env.get(SPOOL_ENV)
        if chosen_spool:
            kwargs["spool_dir"] = Path(chosen_spool)
        chosen_cluster = cluster or env.get(CLUSTER_ENV)
        if chosen_cluster:
            kwargs["cluster"] = chosen_cluster
        if "engine_steps_retention_days" not in kwargs and env.get(RETENTION_ENV):
            try:
                kwargs["engine_steps_retention_days"] = int(env[RETENTION_ENV])
            except ValueError:
                raise ConfigError(
                    f"{RETENTION_ENV} must be a whole number of days, got {env[RETENTION_ENV]!r}") from None
        return cls(**kwargs)  # type: ignore[arg-type]
