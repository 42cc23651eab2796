"""A tiny synchronous publish/subscribe bus for plain stats objects.

Producers (engine hooks, gateway, scheduler, ledger) call ``bus.publish(obj)``; consumers
(exporters, the signal history sampler, the scheduler's KV gating, tests) call
``bus.subscribe(Type, callback)``. Dispatch is by exact type, synchronous and in subscription
order, so a callback must be cheap (update a metric, append to a buffer) — anything slow belongs
on the consumer's own thread or task.

A failing subscriber is logged and skipped, never raised into the serving path (fail loudly at
construction, never crash the host at run time: docs/ARCHITECTURE.md, "Conventions").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable, TypeVar

__all__ = ["StatsBus"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class StatsBus:
    """Type-keyed fan-out of stats objects to subscribers."""

    def __init__(self) -> None:
        self._subs: dict[type, list[Callable[[Any], None]]] = defaultdict(list)
        self.errors_total = 0

    def subscribe(self, kind: type[T], callback: Callable[[T], None]) -> Callable[[], None]:
        """Call ``callback(obj)`` for every published object whose type is exactly ``kind``.

        Returns:
            A function that removes this subscription.
        Raises:
            TypeError: if ``kind`` is not a class or ``callback`` is not callable.
        """
        if not isinstance(kind, type):
            raise TypeError(f"subscribe() needs a class, got {kind!r}")
        if not callable(callback):
            raise TypeError(f"subscribe() needs a callable, got {callback!r}")
        self._subs[kind].append(callback)

        def unsubscribe() -> None:
            try:
                self._subs[kind].remove(callback)
            except ValueError:
                pass

        return unsubscribe

    def publish(self, obj: object) -> None:
        """Hand ``obj`` to each subscriber of its type; errors are logged and counted."""
        for callback in tuple(self._subs.get(type(obj), ())):
            try:
                callback(obj)
            except Exception:  # noqa: BLE001 — a broken exporter must not break serving
                self.errors_total += 1
                log.exception("stats subscriber %r failed on %s", callback, type(obj).__name__)

    def has_subscribers(self, kind: type) -> bool:
        """True if anything listens for ``kind`` (lets producers skip building costly stats)."""
        return bool(self._subs.get(kind))
