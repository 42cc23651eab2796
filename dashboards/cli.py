"""``kvmeter dashboard`` — start the Streamlit dashboards (``streamlit run`` on ``app.py``).

Examples::

    kvmeter dashboard --server http://127.0.0.1:8000          # while kvmeter serve runs (embedded ledger)
    kvmeter dashboard --server http://127.0.0.1:8000 --api-key sk-...   # signed in at start
    kvmeter dashboard --ledger-dsn http://user:pw@ch:8123/kvmeter
    kvmeter dashboard --ledger-dsn chdb://./var/ledger/chdb   # an existing chDB ledger no process holds

The key to sign in with at start: ``--api-key KEY``, else ``KVMETER_DASHBOARD_API_KEY``, else the
sign-in form. Prefer the variable on shared machines: a flag's value shows in the process list.
The key reaches Streamlit through its environment (never its command line) and is never printed.

The dashboards only read: a ``chdb://`` path that does not hold a kvmeter ledger is refused
(exit 2) rather than created empty.

Once the settings are valid, this process *becomes* Streamlit (``os.execvpe``: same pid, same
stdin/stdout/stderr): ``kill PID``, Ctrl-C or ``docker stop`` (kvmeter as PID 1) reach Streamlit
itself, which stops and frees its port — no orphan server is left behind.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvmeter.ledger.config import DEFAULT_DATABASE, parse_dsn, require_existing_ledger
from kvmeter.ledger.connection import chdb_path_held_elsewhere
from kvmeter.ledger.errors import ConfigError as LedgerConfigError

from .config import ENV, DashboardConfig
from .errors import ConfigError
from .window import RANGES

__all__ = ["add_arguments", "run", "streamlit_command", "APP"]

#: The Streamlit entry point.
APP = Path(__file__).with_name("app.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvmeter dashboard`` flags (settings without a flag come from the environment)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--server", metavar="URL", help="read through a running kvmeter serve (needed for the "
                      "embedded ledger while serve holds it), e.g. http://127.0.0.1:8000")
    mode.add_argument("--ledger-dsn", metavar="DSN", help="query ClickHouse directly: http(s)://user:pw@host:port/db "
                      "or chdb:///path no process holds (default $KVMETER_LEDGER_DSN or chdb://./var/ledger/chdb)")
    parser.add_argument("--api-key", metavar="KEY", help="sign in with this key at start (default "
                        "$KVMETER_DASHBOARD_API_KEY, else the sign-in form); the variable keeps the key out "
                        "of the process list")
    parser.add_argument("--tenants", metavar="YAML", help="tenancy file for API keys and tier SLOs with --ledger-dsn "
                        "(default $KVMETER_TENANTS or the demo tenants)")
    parser.add_argument("--prices", metavar="YAML", help="price list for invoice lines with --ledger-dsn")
    parser.add_argument("--refresh", type=float, metavar="S",
                        help="auto-refresh period in seconds, 0 = off (default 30)")
    parser.add_argument("--cache-ttl", type=float, metavar="S", help="query cache lifetime in seconds (default 30)")
    parser.add_argument("--range", choices=list(RANGES), help="initial time range (default 'last 1 h')")
    parser.add_argument("--until", metavar="ISO", help="pin the window's end, e.g. 2026-11-29T02:30:00Z")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8501, help="port to listen on (default 8501)")


def streamlit_command(host: str, port: int) -> list[str]:
    """The ``streamlit run`` command line (headless, no usage statistics)."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
            "--server.address", host, "--server.port", str(port), "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "minimal"]


def check_server(url: str, api_key: str | None, timeout_s: float = 5.0) -> None:
    """Check the serve process once before the dashboard starts: with ``api_key``, the pages' own
    sign-in read (:meth:`HttpSource.whoami`), where a key the server refuses is an error (every
    page would fail); without one (the pages' sign-in form), that ``/healthz`` answers. A server
    that does not answer only gets a warning on stderr (it may still be starting, e.g. under
    docker compose).

    Raises:
        ConfigError: the server answered 401 for ``api_key``.
    """
    import httpx

    from kvmeter.ledger.errors import LedgerUnavailable
    from kvmeter.ledger.http_client import ReadApiError, read_api_get

    from .errors import SignInError
    from .http_source import HttpSource

    try:
        if not api_key:
            with httpx.Client(base_url=url, timeout=timeout_s) as client:
                read_api_get(client, "/healthz", None, url)
            return
        source = HttpSource(url, api_key, timeout_s=timeout_s)
        try:
            source.whoami()
        finally:
            source.close()
    except SignInError as exc:
        raise ConfigError(f"{url} refused the API key ({exc}); "
                          "pass a tenant or admin key of that server with --api-key") from None
    except LedgerUnavailable as exc:
        print(f"kvmeter dashboard: warning: {url} does not answer now ({exc}); the pages will "
              "show an error until it does", file=sys.stderr)
    except ReadApiError as exc:
        print(f"kvmeter dashboard: warning: {url}: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Validate the settings, then replace this process with Streamlit (see the module docstring).

    Returns (only when Streamlit was not started):
        2 on invalid settings (one ``kvmeter dashboard: ...`` line on stderr); 127 when the
        Streamlit command cannot be executed. On success it does not return: Streamlit's exit
        status is the process's.
    """
    explicit = {"server_url": args.server, "ledger_dsn": args.ledger_dsn, "api_key": args.api_key,
                "tenants_path": args.tenants, "prices_path": args.prices, "refresh_s": args.refresh,
                "cache_ttl_s": args.cache_ttl, "default_range": args.range, "until": args.until}
    try:
        config = DashboardConfig.from_env(**explicit)
        if config.mode == "dsn":
            dsn = parse_dsn(config.ledger_dsn)
            require_existing_ledger(dsn, dsn.database or DEFAULT_DATABASE)  # read-only: never create
            if dsn.kind == "chdb" and chdb_path_held_elsewhere(dsn.path):  # else every page would fail
                raise ConfigError(f"the embedded ledger at {dsn.path} is held by another process (a running "
                                  "`kvmeter serve`?); read it through that process with --server URL --api-key KEY")
        for flag, path in (("--tenants", config.tenants_path), ("--prices", config.prices_path)):
            if path is not None and not path.is_file():  # else Streamlit would start, then fail per page
                raise ConfigError(f"{flag} {path}: no such file")
        if config.server_url:  # (the "server" mode)
            check_server(config.server_url, config.api_key)
    except (ConfigError, LedgerConfigError) as exc:
        print(f"kvmeter dashboard: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    for name, var in ENV.items():
        value = getattr(config, name)
        if name == "ledger_dsn" and config.mode == "server":
            continue
        if value is not None:  # the key too: the environment, unlike argv, is private to the user
            env[var] = value.isoformat() if hasattr(value, "isoformat") else str(value)
    if config.mode == "server":
        env.pop(ENV["ledger_dsn"], None)
    print(f"kvmeter dashboard: {config.mode} mode on {config.target}; http://{args.host}:{args.port}", file=sys.stderr)
    argv = streamlit_command(args.host, args.port)
    sys.stdout.flush()  # exec discards Python's buffers
    sys.stderr.flush()
    try:
        # Replace this process rather than run a child: signals sent to this pid (kill, docker stop,
        # Ctrl-C) then go to Streamlit itself, which stops cleanly; a parent that waited on a child
        # would die of SIGTERM and leave the child serving the port, orphaned.
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"kvmeter dashboard: cannot start Streamlit ({argv[0]}): {exc.strerror or exc}", file=sys.stderr)
        return 127
    raise AssertionError("os.execvpe returned")  # unreachable: exec replaces the process or raises
