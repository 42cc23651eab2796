"""Versioned, re-runnable schema migrations — the same DDL on chDB and on a ClickHouse server.

Migrations are the packaged files ``migrations/NNNN_name.sql`` (every mode) and
``migrations/NNNN_name.cluster.sql`` (added in cluster mode). They are ``string.Template``
texts with these variables:

=================  ====================================  ================================================
variable           single node (default)                 cluster mode (``LedgerConfig.cluster = "c"``)
=================  ====================================  ================================================
``$local``         ``""``                                ``"_local"`` (Distributed tables take the names)
``$on_cluster``    ``""``                                ``"ON CLUSTER c"``
``$engine_prefix`` ``""``                                ``"Replicated"`` (default replica path/name macros)
``$dedup_window``  ``non_replicated_deduplication_window  ``replicated_deduplication_window = 10000``
                   = 10000``
``$cluster``       (unused)                              ``c``
=================  ====================================  ================================================

``non_replicated_deduplication_window`` is what makes ``insert_deduplication_token`` work on a
plain MergeTree (measured on chDB 26.9: without it the token is ignored).

Applied versions are kept in ``schema_migrations`` with the SHA-256 of their file(s); every
statement is idempotent (``CREATE ... IF NOT EXISTS``, ``RENAME COLUMN IF EXISTS``, ``DROP ... IF
EXISTS``), so a migration interrupted half-way is simply run again. A changed file for an applied
version is an error (fix it with a new version).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from string import Template

from clickhouse_connect.driver.client import Client

from .errors import MigrationError

__all__ = ["Migration", "load_migrations", "render", "migrate", "applied_versions"]

log = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+?)(\.cluster)?\.sql$")

_BOOTSTRAP = """
CREATE TABLE IF NOT EXISTS schema_migrations$local $on_cluster (
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree(applied_at)
ORDER BY version;
"""
_BOOTSTRAP_CLUSTER = """
CREATE TABLE IF NOT EXISTS schema_migrations $on_cluster AS schema_migrations_local
ENGINE = Distributed($cluster, currentDatabase(), schema_migrations_local, version);
"""


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema version: its statements (rendered for the mode) and the checksum of its files."""

    version: int
    name: str
    statements: tuple[str, ...]
    checksum: str


def _variables(cluster: str | None) -> dict[str, str]:
    if cluster:
        return {"local": "_local", "on_cluster": f"ON CLUSTER {cluster}", "engine_prefix": "Replicated",
                "dedup_window": "replicated_deduplication_window = 10000", "cluster": cluster}
    return {"local": "", "on_cluster": "", "engine_prefix": "",
            "dedup_window": "non_replicated_deduplication_window = 10000", "cluster": ""}


def render(sql: str, cluster: str | None = None) -> list[str]:
    """Substitute the template variables and split into statements.

    Statements end with ``;`` at the end of a line; ``--`` comment lines are dropped.
    Raises:
        MigrationError: on an unknown ``$variable``.
    """
    try:
        text = Template(sql).substitute(_variables(cluster))
    except (KeyError, ValueError) as exc:
        raise MigrationError(f"migration template has an unknown or bad variable: {exc}") from None
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    statements, current = [], []
    for line in lines:
        current.append(line)
        if line.rstrip().endswith(";"):
            stmt = "\n".join(current).strip().rstrip(";").strip()
            if stmt:
                statements.append(stmt)
            current = []
    tail = "\n".join(current).strip()
    if tail:
        statements.append(tail)
    return statements


def load_migrations(cluster: str | None = None) -> list[Migration]:
    """The packaged migrations in version order, rendered for single-node or cluster mode."""
    files: dict[int, dict[str, tuple[str, str]]] = {}
    for entry in resources.files("kvmeter.ledger").joinpath("migrations").iterdir():
        m = _FILE.match(entry.name)
        if not m:
            continue
        version, name, is_cluster = int(m.group(1)), m.group(2), bool(m.group(3))
        files.setdefault(version, {})["cluster" if is_cluster else "base"] = (name, entry.read_text("utf-8"))
    out = []
    for version in sorted(files):
        parts = files[version]
        if "base" not in parts:
            raise MigrationError(f"migration {version:04d} has a cluster file but no base file")
        name, base = parts["base"]
        digest = hashlib.sha256(base.encode())
        statements = render(base, cluster)
        if "cluster" in parts:
            cluster_text = parts["cluster"][1]
            digest.update(b"\x00" + cluster_text.encode())
            if cluster:
                statements += render(cluster_text, cluster)
        out.append(Migration(version, name, tuple(statements), digest.hexdigest()))
    return out


def applied_versions(client: Client) -> dict[int, str]:
    """version → checksum of the migrations recorded in ``schema_migrations``."""
    rows = client.query(
        "SELECT version, argMax(checksum, applied_at) FROM schema_migrations GROUP BY version").result_rows
    return {int(v): str(c) for v, c in rows}


def migrate(client: Client, cluster: str | None = None, *, up_to: int | None = None) -> list[int]:
    """Bring the client's database to the newest schema (or to version ``up_to``).

    Args:
        client: a client whose default database is the ledger's.
        cluster: cluster name for the Replicated/Distributed DDL, or ``None``.
        up_to: apply the versions up to this one only (the schema an older kvmeter created, e.g.
            to test an upgrade); ``None``: all.
    Returns:
        The versions applied by this call (empty when already current).
    Raises:
        MigrationError: if a statement fails or an applied migration's file changed.
    """
    try:
        for stmt in render(_BOOTSTRAP, cluster) + (render(_BOOTSTRAP_CLUSTER, cluster) if cluster else []):
            client.command(stmt)
        applied = applied_versions(client)
    except Exception as exc:  # noqa: BLE001 — translated at the boundary
        raise MigrationError(f"cannot read or create schema_migrations: {exc}") from exc
    done = []
    for migration in load_migrations(cluster):
        if up_to is not None and migration.version > up_to:
            break
        known = applied.get(migration.version)
        if known is not None:
            if known != migration.checksum:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} changed after it was applied "
                    f"(checksum {known[:12]}… in the database, {migration.checksum[:12]}… on disk); "
                    "add a new migration instead of editing an applied one")
            continue
        for stmt in migration.statements:
            try:
                client.command(stmt)
            except Exception as exc:  # noqa: BLE001
                raise MigrationError(f"migration {migration.version:04d}_{migration.name} failed: {exc}") from exc
        client.insert("schema_migrations", [[migration.version, migration.name, migration.checksum]],
                      column_names=["version", "name", "checksum"])
        log.info("ledger schema: applied migration %04d_%s", migration.version, migration.name)
        done.append(migration.version)
    return done
