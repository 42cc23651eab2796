"""``kvmeter serve --workers N``: N gateway processes on one port, under uvicorn's supervisor.

The parent binds the port once and runs :class:`Supervisor`, uvicorn's own multi-process supervisor
(``uvicorn.supervisors.Multiprocess``: it starts N spawned workers on the shared socket, pings them,
replaces one that died or hung, stops them all on SIGINT/SIGTERM), with one hook added: a worker
that is gone — died, killed, replaced, retired — is marked dead in the Prometheus multiprocess
directory (:func:`~kvmeter.exporters.prometheus.mark_worker_dead`), so the ``live*`` gauges it last
set (in-flight KV, queue depths, pending settles) drop out of the merged ``/metrics`` at once.

What the workers share, and what each has (docs/ARCHITECTURE.md, "How each part starts"):

* **engine** — shared by construction: ``remote`` (every worker proxies to the same upstream
  server) or ``instant`` (stateless). The in-process vLLM engine would load one model copy per
  worker: refused.
* **quota, idempotency records, agent-run state** — one Redis (``redis://``, ``rediss://``) for
  all: global limits hold across workers, a retry may land on any worker, and concurrency / KV
  holds carry each worker's lease (``quota_lease_s``), so a killed worker's holds are free within
  it. ``memory://`` would give each worker its own limits: refused.
* **ledger** — ClickHouse over HTTP, written by every worker; embedded chDB opens in one process
  only: refused. Each worker has its own **spool**, the slot directory ``<spool_dir>/worker-<k>``
  it claims at start (:func:`claim_slot`: the lowest slot no live process holds), so a
  replacement takes the dead worker's slot and drains what it left durable there.
* **Prometheus** — ``PROMETHEUS_MULTIPROC_DIR`` (default ``<spool_dir>/prometheus``), emptied by
  the parent before the workers start; any worker's ``/metrics`` serves the merged view.
* **per worker, and why that is safe** — the fair scheduler and its queues (each worker schedules
  the requests it accepted; engine-wide limits such as ``max_engine_running`` are per worker), the
  ledger's drain and its hourly rollup refresh (a drain is per spool; the rollup recomputes whole
  hours from deduplicated rows, so N refreshes write the same rows), the GPU poller and the
  tenants-file watcher (each process reads for itself), the self-checks (counters, summed).
* **once per fleet, in slot 0** — periodic reconciliation (its queries read the whole ledger) and
  the signal history (one sampler's rows; N samplers would interleave N processes' views in one
  series).

Every response carries ``x-kvmeter-worker`` (the slot) and ``x-kvmeter-worker-pid``.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.supervisors.multiprocess import Multiprocess

from kvmeter.exporters.prometheus import mark_worker_dead, prepare_multiprocess_dir
from kvmeter.exporters.prometheus.app import MULTIPROC_ENV
from kvmeter.net import listening_socket

if TYPE_CHECKING:
    from kvmeter.ledger.config import LedgerConfig
    from kvmeter.serving.config import ServeConfig

__all__ = ["workers_problem", "worker_spool_dir", "claim_slot", "worker_app", "WorkerHeaders", "Supervisor",
           "run_workers", "SLOT_PREFIX"]

log = logging.getLogger(__name__)

#: a worker slot's spool directory is ``<spool_dir>/<SLOT_PREFIX><k>``; its claim lock beside it
SLOT_PREFIX = "worker-"

_claimed: list[int] = []  # this process's claim lock fds: held for the life of the process


def workers_problem(config: ServeConfig, ledger: LedgerConfig) -> str | None:
    """Why ``config`` cannot run with ``config.server.workers`` processes, or ``None`` if it can
    (always ``None`` for one worker)."""
    from kvmeter.serving.quota.backends import scheme_of

    n = config.server.workers
    if n == 1:
        return None
    if config.engine.kind == "vllm":
        return (f"--workers {n} needs a shared engine: the in-process vLLM engine would load one copy of the "
                "model per worker; run `vllm serve` and use --engine remote --remote-url (or --workers 1)")
    if scheme_of(config.quota_store) == "memory":
        return (f"--workers {n} needs a shared quota store: with memory:// every worker would enforce its own "
                "limits, idempotency records and agent runs; use --quota-store redis://host:port/db")
    if ledger.embedded:
        return (f"--workers {n} needs a ledger every worker can write: the embedded chDB ledger "
                f"({ledger.dsn}) opens in one process only; use --ledger-dsn http(s)://user:pw@host:port/db "
                "(ClickHouse over HTTP)")
    return None


def worker_spool_dir(spool_root: Path, slot: int) -> Path:
    """The spool directory of worker slot ``slot`` (>= 0) under the configured spool dir."""
    return Path(spool_root) / f"{SLOT_PREFIX}{slot}"


def claim_slot(spool_root: Path) -> int:
    """Claim the lowest worker slot no live process holds, for the life of this process.

    The claim is an ``flock`` on ``<spool_root>/worker-<k>.lock``, which the kernel releases when
    the holder exits however it exits, so a replacement worker claims the slot — and opens the
    spool, with what is still undrained in it — of the worker it replaces. Slots beyond N are
    claimed only while more than N workers live at once (uvicorn's SIGHUP restart starts each
    replacement before it stops the old worker).

    Returns:
        the slot number, 0-based.
    Raises:
        OSError: the spool dir cannot be created or a lock file opened.
    """
    root = Path(spool_root)
    root.mkdir(parents=True, exist_ok=True)
    slot = 0
    while True:
        fd = os.open(root / f"{SLOT_PREFIX}{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            slot += 1
            continue
        _claimed.append(fd)
        return slot


class WorkerHeaders:
    """ASGI middleware: ``x-kvmeter-worker: <slot>`` and ``x-kvmeter-worker-pid: <pid>`` on every
    HTTP response, so a client (or a test) sees which worker answered."""

    def __init__(self, app: Any, slot: int) -> None:
        self.app = app
        self._headers = [(b"x-kvmeter-worker", str(slot).encode()),
                         (b"x-kvmeter-worker-pid", str(os.getpid()).encode())]

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 — ASGI
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message) -> None:  # noqa: ANN001
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self._headers]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def logger_levels() -> dict[str, int]:
    """The levels set on named loggers in this process (``kvmeter``'s CLI quiets httpx and httpcore
    unless ``-v``): what a spawned worker applies so it logs as the one process would."""
    return {name: lg.level for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET}


def configure_worker_logging(log_level: str, levels: dict[str, int]) -> None:
    """A spawned worker's logging: the root at ``log_level`` and the named loggers at the parent's
    :func:`logger_levels` (a spawned process starts with none of them set)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def worker_app(config_json: str, log_level: str, levels: dict[str, int] | None = None) -> WorkerHeaders:
    """The app factory each spawned worker runs (uvicorn ``factory=True``): claim a slot, build
    this worker's :class:`~kvmeter.serving.runtime.ServeRuntime` from the serve config (JSON, as
    the parent validated it) and return its app.

    Raises:
        ValueError, ModelError, EngineError, OSError: as :class:`ServeRuntime` does; uvicorn logs it
            and the worker exits, and its supervisor stops the server when a worker fails to start.
    """
    from kvmeter.serving.config import ServeConfig
    from kvmeter.serving.runtime import ServeRuntime, ledger_config_of

    configure_worker_logging(log_level, levels or {})
    config = ServeConfig.model_validate_json(config_json)
    slot = claim_slot(ledger_config_of(config).spool_dir)
    log.info("kvmeter serve worker %d: pid %d", slot, os.getpid())
    runtime = ServeRuntime(config, worker=slot)
    return WorkerHeaders(runtime.app(), slot)


class Supervisor(Multiprocess):
    """uvicorn's multi-process supervisor, marking every worker that is gone as dead in the
    Prometheus multiprocess directory ``multiproc_dir`` (uvicorn has no child-exit hook: after each
    of its steps, the pids it no longer runs are compared with the ones it ran).

    ``startup_failed`` is set when uvicorn stopped because a worker failed to start (its app
    factory or lifespan startup raised: the config, the engine or the ledger).
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], *, multiproc_dir: Path) -> None:
        super().__init__(config, sockets)
        self.multiproc_dir = multiproc_dir
        self.startup_failed = False
        self._known: set[int] = set()

    def _mark_gone(self) -> None:
        live = {p.pid for p in self.processes if p.pid is not None}
        for pid in self._known - live:
            mark_worker_dead(pid, self.multiproc_dir)
            log.info("kvmeter serve: worker pid %d gone; its live gauges dropped", pid)
        self._known = live

    def init_processes(self) -> None:
        super().init_processes()
        self._mark_gone()

    def keep_subprocess_alive(self) -> None:
        stopping = self.should_exit.is_set()
        super().keep_subprocess_alive()  # sets should_exit only when a worker failed to start
        self.startup_failed = self.startup_failed or (not stopping and self.should_exit.is_set())
        self._mark_gone()

    def handle_signals(self) -> None:  # SIGHUP restart, SIGTTOU retire: workers replaced
        super().handle_signals()
        self._mark_gone()

    def join_all(self) -> None:
        super().join_all()
        self.processes = []
        self._mark_gone()


def workers_uvicorn_config(config: ServeConfig) -> uvicorn.Config:
    """The uvicorn configuration of the workers' supervisor: each worker builds its app with
    :func:`worker_app` (the serve config as JSON, the parent's log levels), and may take
    ``server.worker_healthcheck_timeout_s`` to answer a liveness ping."""
    server = config.server
    return uvicorn.Config(
        # the workers log at the parent's level (``kvmeter --log-level``), as the one process would
        functools.partial(worker_app, config.model_dump_json(),
                          logging.getLevelName(logging.getLogger().getEffectiveLevel()), logger_levels()),
        factory=True,
        host=server.host, port=server.port, workers=server.workers, log_level=server.log_level,
        lifespan="on", timeout_graceful_shutdown=30, access_log=False,
        timeout_worker_healthcheck=server.worker_healthcheck_timeout_s)


def run_workers(config: ServeConfig, ledger: LedgerConfig, *, multiproc_dir: Path | None = None) -> int:
    """Run ``config.server.workers`` gateway workers on ``config.server``'s host and port until
    SIGINT/SIGTERM; returns the exit status: 0 after a stop, 3 when a worker failed to start.

    Sets ``PROMETHEUS_MULTIPROC_DIR`` (``multiproc_dir``, else the variable's value, else
    ``<spool_dir>/prometheus``) and empties it before any worker starts: each spawned worker
    imports prometheus_client with it set.

    Raises:
        OSError: the port cannot be bound (checked by the caller's preflight first).
    """
    directory = multiproc_dir or Path(os.environ.get(MULTIPROC_ENV) or ledger.spool_dir / "prometheus")
    prepare_multiprocess_dir(directory)
    os.environ[MULTIPROC_ENV] = str(directory)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads across the spawn
    uv_config = workers_uvicorn_config(config)
    sock = listening_socket(uv_config, config.server.send_buffer_bytes)
    supervisor = Supervisor(uv_config, [sock], multiproc_dir=directory)
    try:
        supervisor.run()
    finally:
        sock.close()
    return 3 if supervisor.startup_failed else 0
