"""ClickHouse connections for the ledger: one client per thread that uses it, errors mapped here.

Both targets go through ``clickhouse-connect``: the embedded engine with
``get_client(dsn="chdb:///path")``, a server with ``get_client(host=..., port=...)``.

chDB on disk is single-process: the process that opens the path owns it (any number of client
handles inside that process share it). A second process gets :class:`LedgerLocked` with the
advice to read through the owner's read API.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError, DatabaseError, OperationalError, ProgrammingError

from .config import LedgerConfig
from .errors import LedgerLocked, LedgerUnavailable, LedgerError
from .spool import lock_held_elsewhere

__all__ = ["ClientFactory", "connect", "ClientHolder", "QueryRunner", "is_data_error", "describe_error",
           "chdb_path_held_elsewhere", "embedded_held_elsewhere"]

log = logging.getLogger(__name__)

ClientFactory = Callable[[], Client]

#: The file ClickHouse (chDB) holds an ``flock`` on in its data directory while a process has it open.
CHDB_STATUS_FILE = "status"


def chdb_path_held_elsewhere(path: str | Path) -> bool:
    """Whether another process has the chDB data directory ``path`` open now — a probe of chDB's
    lock on its status file, for start-up checks. False for a path that holds no ledger yet."""
    return lock_held_elsewhere(Path(path) / CHDB_STATUS_FILE)


def embedded_held_elsewhere(config: LedgerConfig) -> bool:
    """:func:`chdb_path_held_elsewhere` for the embedded (``chdb://``) ledger of ``config``; False
    for a server DSN."""
    return config.embedded and chdb_path_held_elsewhere(config.parsed_dsn.path)

#: ClickHouse error codes that mean "this data cannot be inserted" (retrying will not help):
#: CANNOT_PARSE_* (6, 25, 26, 27, 38, 41, 72, 376), ATTEMPT_TO_READ_AFTER_EOF (32),
#: CANNOT_READ_ALL_DATA (33), TYPE_MISMATCH (53), ARGUMENT_OUT_OF_BOUND (69),
#: CANNOT_CONVERT_TYPE (70), INCORRECT_DATA (117), TOO_LARGE_STRING_SIZE (131),
#: VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE (321), CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN (349),
#: DECIMAL_OVERFLOW (407), INCORRECT_NUMBER_OF_COLUMNS (7), UNKNOWN_ELEMENT_OF_ENUM (691).
DATA_ERROR_CODES = frozenset({6, 7, 25, 26, 27, 32, 33, 38, 41, 53, 69, 70, 72, 117, 131, 321, 349, 376, 407, 691})


def is_data_error(exc: BaseException) -> bool:
    """True if ClickHouse refused an insert because of its data (not the connection)."""
    return (isinstance(exc, DatabaseError) and not isinstance(exc, OperationalError)
            and getattr(exc, "code", None) in DATA_ERROR_CODES)


def describe_error(exc: BaseException) -> str:
    """One line for logs: the exception class and message, first 300 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _ensure_database(client: Client, database: str, cluster: str | None) -> None:
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}{on_cluster}")
    client.database = database


def connect(config: LedgerConfig) -> Client:
    """Open a clickhouse-connect client for ``config`` with its database created and selected.

    Returns:
        A client whose default database is :attr:`LedgerConfig.effective_database`.
    Raises:
        LedgerLocked: the chDB path is held by another process.
        LedgerUnavailable: the server cannot be reached or refused us.
    """
    dsn = config.parsed_dsn
    database = config.effective_database
    try:
        if dsn.kind == "chdb":
            client = clickhouse_connect.get_client(dsn=f"chdb://{dsn.path}")
        else:
            client = clickhouse_connect.get_client(
                host=dsn.host, port=dsn.port, username=dsn.username, password=dsn.password,
                secure=dsn.secure, database="default", connect_timeout=config.connect_timeout_s,
                send_receive_timeout=config.query_timeout_s, autogenerate_session_id=False,
                query_retries=0)
    except ProgrammingError as exc:
        if dsn.kind == "chdb" and "EmbeddedServer" in str(exc):
            raise LedgerLocked(
                f"the embedded ledger at {dsn.path} is held by another process (a running "
                "`kvmeter serve`?); read it through that process with --server URL --api-key KEY, "
                "or stop it first") from None
        raise LedgerUnavailable(f"cannot open ClickHouse at {dsn.redacted()}: {describe_error(exc)}") from None
    except (ClickHouseError, OSError) as exc:
        raise LedgerUnavailable(f"cannot reach ClickHouse at {dsn.redacted()}: {describe_error(exc)}") from None
    try:
        _ensure_database(client, database, config.cluster)
    except (ClickHouseError, OSError) as exc:
        client.close()
        raise LedgerUnavailable(
            f"cannot create database {database} at {dsn.redacted()}: {describe_error(exc)}") from None
    return client


class ClientHolder:
    """Lazily connected, migrated client, reconnected after failures.

    One holder per thread that talks to ClickHouse (the writer thread has its own; the query
    path shares one, whose calls clickhouse-connect serialises per client).

    Args:
        factory: opens a client (``lambda: connect(config)`` by default in the ledger; tests
            inject one that fails for a while).
        prepare: run once on each new client before use (migrations).
    """

    def __init__(self, factory: ClientFactory, prepare: Callable[[Client], Any] | None = None) -> None:
        self._factory = factory
        self._prepare = prepare
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> Client:
        """The connected client.

        Raises:
            LedgerLocked: as :func:`connect`.
            LedgerUnavailable: if it cannot connect or prepare now.
        """
        with self._lock:
            if self._closed:
                raise LedgerUnavailable("the ledger is closed")
            if self._client is not None:
                return self._client
            try:
                client = self._factory()
            except LedgerError:
                raise
            except Exception as exc:  # noqa: BLE001 — any factory failure is an outage
                raise LedgerUnavailable(f"cannot connect to ClickHouse: {describe_error(exc)}") from None
            if self._prepare is not None:
                try:
                    self._prepare(client)
                except LedgerError:
                    _close_quietly(client)
                    raise
                except Exception as exc:  # noqa: BLE001
                    _close_quietly(client)
                    raise LedgerUnavailable(f"cannot prepare the ClickHouse schema: {describe_error(exc)}") from None
            self._client = client
            return client

    @property
    def connected(self) -> bool:
        """True while a client is held."""
        return self._client is not None

    def reset(self) -> None:
        """Drop the client (after an error); the next :meth:`get` reconnects."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def close(self) -> None:
        """Close for good."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)


class QueryRunner:
    """Runs the ledger's read queries on one client: the plumbing every query class shares.

    Values travel as bound parameters (``{name:Type}`` server-side binding), never spliced into
    the SQL. Calls on one client are serialised by clickhouse-connect (its chDB backend holds a
    lock per handle), so any number of threads may share a runner.

    Args:
        client: a :class:`ClientHolder` (reset after a connection failure, so the next query
            reconnects) or a zero-argument function returning a connected client.
    """

    def __init__(self, client: ClientHolder | Callable[[], Client]) -> None:
        self.holder = client if isinstance(client, ClientHolder) else None
        self.get_client: Callable[[], Client] = client.get if isinstance(client, ClientHolder) else client

    def rows(self, sql: str, params: dict[str, Any], settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The result of ``sql`` as one dict per row (column name → value, as clickhouse-connect
        decodes it).

        Raises:
            LedgerUnavailable: ClickHouse cannot be reached (or the connection broke).
            LedgerError: ClickHouse refused the query.
        """
        client = self.get_client()
        try:
            result = client.query(sql, parameters=params, settings=settings)
        except LedgerError:
            raise
        except (OperationalError, OSError) as exc:  # the connection: reconnect next time
            if self.holder is not None:
                self.holder.reset()
            raise LedgerUnavailable(f"ledger query failed: {describe_error(exc)}") from None
        except Exception as exc:  # noqa: BLE001 — translate at the boundary
            raise LedgerError(f"ledger query failed: {describe_error(exc)}") from None
        return list(result.named_results())

    def close(self) -> None:
        """Close the client if the runner holds a :class:`ClientHolder` (idempotent)."""
        if self.holder is not None:
            self.holder.close()


def _close_quietly(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001
        log.debug("closing a ClickHouse client failed", exc_info=True)
