"""In-process quota store: the embedded default.

Counters live in one dict guarded by one lock, so a reservation is atomic against every other
reservation of the process (asyncio tasks and OS threads alike). Semantics are those of the Redis
Lua scripts, operation for operation (see :mod:`kvmeter.serving.quota.gcra`), so the same tests
run on both.

Expiry: keys with a TTL (spend periods, agent runs) and rate keys whose bucket is full again are
dropped by a sweep every :attr:`MemoryQuotaStore.sweep_interval_s` seconds of store time.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from kvmeter.serving.quota.plan import COUNTER, RATE, SETTLE_ADJUST, SETTLE_RELEASE, PlanItem
from kvmeter.serving.quota.store import QuotaStore, ReserveResult

__all__ = ["MemoryQuotaStore"]


def _b(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else key


class MemoryQuotaStore(QuotaStore):
    """Quota counters in a dict.

    Args:
        key_prefix: prefix of the keys plans are compiled with.
        sweep_interval_s: seconds (on the ``now`` passed in) between expiry sweeps (> 0).
    """

    name = "memory"

    def __init__(self, key_prefix: str = "kvq:", *, sweep_interval_s: float = 60.0) -> None:
        if sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {sweep_interval_s}")
        self.key_prefix = key_prefix
        self.sweep_interval_s = sweep_interval_s
        self._v: dict[bytes, Any] = {}  # key -> TAT (rate), count (counter) or start time (deadline)
        self._exp: dict[bytes, float] = {}
        self._rate_keys: set[bytes] = set()
        self._lock = threading.Lock()
        self._next_sweep = float("-inf")

    # The async methods run the synchronous critical section directly: there is no I/O to await.

    async def reserve(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                      now: float) -> ReserveResult:
        return self.reserve_sync(items, keys, src, now)

    def reserve_sync(self, items: Sequence[PlanItem], keys: Sequence[bytes], src: Sequence[int],
                     now: float) -> ReserveResult:
        """Synchronous :meth:`reserve` (for threads and benchmarks)."""
        v = self._v
        n = len(items)
        new_values: list[Any] = [None] * n
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            for i in range(n):
                it = items[i]
                cur = v.get(keys[i])
                kind = it.kind
                if kind == RATE:
                    tat = cur if cur is not None and cur >= now else now
                    new = tat + src[it.source] * it.interval_s
                    if new - now > it.period_s:
                        return ReserveResult(False, i, new - it.period_s - now, tat, now=now)
                    new_values[i] = new
                elif kind == COUNTER:
                    c = cur or 0
                    if c + src[it.source] > it.limit:
                        return ReserveResult(False, i, None, c, now=now)
                    new_values[i] = c
                else:  # DEADLINE: the run's first call starts its clock
                    if cur is not None and now - cur > it.period_s:
                        return ReserveResult(False, i, None, cur, now=now)
            exp = self._exp
            states = []
            for i in range(n):
                it = items[i]
                key = keys[i]
                kind = it.kind
                if kind == RATE:
                    v[key] = new_values[i]
                    states.append(new_values[i])
                    self._rate_keys.add(key)
                elif kind == COUNTER:
                    a = src[it.source]
                    if a:
                        v[key] = new_values[i] + a
                        if it.ttl_s and not new_values[i]:  # expiry counts from creation
                            exp[key] = now + it.ttl_s
                elif key not in v:
                    v[key] = now
                    exp[key] = now + it.ttl_s
        return ReserveResult(True, -1, None, None, states, now=now)

    async def settle(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                     actual: Sequence[int], now: float, token: Any = None) -> None:
        self.settle_sync(items, keys, reserved, actual, now)

    def settle_sync(self, items: Sequence[PlanItem], keys: Sequence[bytes], reserved: Sequence[int],
                    actual: Sequence[int], now: float) -> None:
        """Synchronous :meth:`settle`."""
        v = self._v
        adjust = [a - r for a, r in zip(actual, reserved, strict=True)]
        release = [-r for r in reserved]
        with self._lock:
            for i in range(len(items)):
                it = items[i]
                rule = it.settle
                if rule == SETTLE_ADJUST:
                    d = adjust[it.source]
                elif rule == SETTLE_RELEASE:
                    d = release[it.source]
                else:
                    continue
                if not d:
                    continue
                key = keys[i]
                if it.kind == RATE:
                    cur = v.get(key)
                    tat = cur if cur is not None and cur >= now else now
                    new = tat + d * it.interval_s
                    if new > now:
                        v[key] = new
                        self._rate_keys.add(key)
                    else:
                        v.pop(key, None)
                elif it.kind == COUNTER:
                    old = v.get(key) or 0
                    new = old + d
                    if new > 0:
                        v[key] = new
                        if it.ttl_s and not old:
                            self._exp[key] = now + it.ttl_s
                    else:
                        v.pop(key, None)
                        self._exp.pop(key, None)

    async def add(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        return self.add_sync(key, amount, ttl_s, now)

    def add_sync(self, key: bytes | str, amount: int, ttl_s: int, now: float) -> int:
        """Synchronous :meth:`add` (the agent-run store counts a run's tool calls with it inside
        its own critical section)."""
        key = _b(key)
        with self._lock:
            new = (self._v.get(key) or 0) + amount
            self._v[key] = new
            if ttl_s:
                self._exp[key] = now + ttl_s
            return new

    async def get_values(self, keys: Sequence[bytes | str]) -> list[float | None]:
        with self._lock:
            return [self._v.get(_b(k)) for k in keys]

    def _sweep(self, now: float) -> None:
        v, exp = self._v, self._exp
        for key in [k for k, t in exp.items() if t <= now]:
            exp.pop(key, None)
            v.pop(key, None)
        full = [k for k in self._rate_keys if (v.get(k) is None or v[k] <= now)]
        for key in full:
            self._rate_keys.discard(key)
            if key in v and v[key] <= now:
                del v[key]
        self._next_sweep = now + self.sweep_interval_s

    def __len__(self) -> int:
        """Keys currently held (for tests and memory accounting)."""
        return len(self._v)
