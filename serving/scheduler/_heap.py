"""A lazy min-heap over mutable items whose keys only grow while they sit in the heap.

The scheduler keeps tenants (and tiers) in a binary heap keyed on a value that the scheduler
increases in place (a VTC counter, the arrival sequence of a queue's head). Rather than re-heapify
on every charge, an entry may hold a *stale* key that is ≤ the item's current key; :meth:`top`
repairs such entries when they surface: if the top entry's key is current it is the true minimum
(every other entry's key ≤ its item's current key), otherwise the entry is re-pushed with the
current key. A key that may *decrease* must be re-inserted with :meth:`push`. Removal is lazy: a
live-token map says which entry is current for each item.

Costs: ``push`` O(log n); ``remove`` O(1); ``top`` amortised O(log n) per repaired entry.
"""

from __future__ import annotations

import heapq
from typing import Callable, Generic, TypeVar

__all__ = ["LazyMinHeap"]

T = TypeVar("T")


class LazyMinHeap(Generic[T]):
    """Min-heap of hashable items keyed by ``key(item)``, tolerant of keys that grow in place."""

    __slots__ = ("_heap", "_live", "_key", "_seq")

    def __init__(self, key: Callable[[T], float]) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._live: dict[T, int] = {}
        self._key = key
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item in self._live

    def push(self, item: T) -> None:
        """Insert ``item`` (or re-insert it with its current key, superseding older entries)."""
        self._seq += 1
        self._live[item] = self._seq
        heapq.heappush(self._heap, (self._key(item), self._seq, item))
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
            self._compact()

    def remove(self, item: T) -> None:
        """Forget ``item`` (no-op if absent)."""
        self._live.pop(item, None)

    def top(self) -> T | None:
        """The item with the least current key, or ``None`` when empty. Ties: insertion order."""
        heap, live, key = self._heap, self._live, self._key
        while heap:
            k, seq, item = heap[0]
            if live.get(item) != seq:
                heapq.heappop(heap)
                continue
            cur = key(item)
            if cur > k:  # stale (the key grew in place): re-file under the current key
                heapq.heapreplace(heap, (cur, seq, item))
                continue
            return item
        return None

    def items(self) -> list[T]:
        """The live items, in no particular order."""
        return list(self._live)

    def _compact(self) -> None:
        key, live = self._key, self._live
        self._heap = [(key(item), seq, item) for item, seq in live.items()]
        heapq.heapify(self._heap)
