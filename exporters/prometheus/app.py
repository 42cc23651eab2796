"""The ``/metrics`` endpoint and prometheus-client multiprocess mode for several gateway workers.

Single process (default): metrics live in one registry, served as is.

Several worker processes (``uvicorn --workers N``, gunicorn): set ``PROMETHEUS_MULTIPROC_DIR`` to
an empty directory in the parent *before* the workers start (and before anything imports
prometheus_client in them — the value class is chosen at import). Each worker then writes its
samples to memory-mapped files there, and :func:`metrics_asgi_app` serves a registry that merges
every worker's files on each scrape: counters and histograms are summed, gauges follow their
declared ``multiprocess_mode`` (see :mod:`.names`), so whichever worker answers the scrape, the
numbers are the whole server's. Call :func:`prepare_multiprocess_dir` in the parent to empty it at
start, and :func:`mark_worker_dead` from a process manager's child-exit hook so ``live*`` gauges
drop a dead worker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app, multiprocess

__all__ = ["metrics_asgi_app", "MetricsApp", "multiprocess_registry", "prepare_multiprocess_dir", "mark_worker_dead",
           "MULTIPROC_ENV"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_registry(path: str | os.PathLike | None = None) -> CollectorRegistry:
    """A fresh registry that merges every worker's files in ``path`` (default: the env var).

    Raises:
        ValueError: if no directory is given or set, or it does not exist.
    """
    path = path or os.environ.get(MULTIPROC_ENV)
    if not path or not Path(path).is_dir():
        raise ValueError(f"multiprocess mode needs an existing directory ({MULTIPROC_ENV}={path!r})")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(path))
    return registry


class MetricsApp:
    """An ASGI application object serving one registry.

    A class instance rather than a plain function so that Starlette's ``Route("/metrics",
    endpoint=app)`` treats it as an ASGI app (it wraps plain functions as request handlers).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._app = make_asgi_app(registry)

    async def __call__(self, scope, receive, send) -> None:
        await self._app(scope, receive, send)


def metrics_asgi_app(registry: CollectorRegistry | None = None, *,
                     multiprocess_dir: str | os.PathLike | None = None) -> MetricsApp:
    """An ASGI app answering ``GET`` with the Prometheus text exposition.

    Args:
        registry: the registry to serve in single-process mode (default: the global one).
        multiprocess_dir: serve the merged multiprocess files of this directory; default: the
            ``PROMETHEUS_MULTIPROC_DIR`` variable when set (then ``registry`` is ignored, since
            in that mode values live in the files, not in a registry).
    Returns:
        An ASGI app; route it with ``Route("/metrics", endpoint=metrics_asgi_app())`` (or
        ``Mount``). It answers GET with the text exposition (gzip if the scraper accepts it).
    """
    directory = multiprocess_dir or os.environ.get(MULTIPROC_ENV)
    if directory:
        return MetricsApp(multiprocess_registry(directory))
    return MetricsApp(registry if registry is not None else REGISTRY)


def prepare_multiprocess_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` or empty it (stale files from a previous run would be merged in).

    Call once in the parent process, before workers start. Returns the directory.
    """
    path = Path(path)
    if path.exists():
        for child in path.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def mark_worker_dead(pid: int, path: str | os.PathLike | None = None) -> None:
    """Tell multiprocess mode that worker ``pid`` exited (drops it from ``live*`` gauges)."""
    multiprocess.mark_process_dead(pid, str(path or os.environ[MULTIPROC_ENV]))
