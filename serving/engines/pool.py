"""An engine pool: N replicas of one model — remote vLLM servers by URL — under one fair scheduler.

Each replica is a :class:`~kvmeter.serving.engines.remote.RemoteEngine` (its connection pool, its
``/metrics`` scraped every ``scrape_interval_s``; the load it publishes carries its index,
``EngineLoad.replica``, which the serve runtime hands to the scheduler's gate of that replica).
Which replica takes a dispatched request is the scheduler's router's choice
(:mod:`kvmeter.serving.scheduler.router`); the grant carries it (``Grant.engine_idx``) and the
gateway's remote path opens the request on it (:meth:`EnginePool.open`).

**Health.** A replica is *down* after a scrape of its ``/metrics`` fails or a connection to it
cannot be made; it is *up* again after a scrape succeeds or, probed every ``probe_interval_s`` (on
the injected clock) while down, it answers ``GET /v1/models`` with the pool's model. A replica is
*draining* while an operator has taken it out (:meth:`EnginePool.drain`): what it runs goes on,
nothing new goes to it. Every change is published as a :class:`~kvmeter.stats.ReplicaHealth` (the
runtime opens or closes the scheduler's gate of the replica; the exporter's ``kvmeter_replica_up``).
A replica that does not answer at start is down, not fatal, while another one answers.

**Failures** (the gateway's remote path): a replica that cannot be reached before answering —
connection refused, connect timeout — is marked down and the request moved to another replica
(``SchedulerCore.reroute``, a ``failover`` decision) and sent there: no engine work was done on the
first, nothing is billed for it. A replica that dies mid-stream ends the request with the stream's
error event (``upstream_error``, naming the replica) and the request is billed the tokens the
replica streamed (the remote path's rule for a broken stream; docs/ARCHITECTURE.md, metering).
While no replica can take work — every one down or draining — the scheduler refuses new requests at
once and ends the queued ones with a 503 ``no_replica_available`` naming the model
(:meth:`~kvmeter.serving.scheduler.core.SchedulerCore.no_replica`; billed nothing); a replica that
answers a probe again opens its gate and requests are served again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import AsyncGenerator, Sequence

import httpx

from kvmeter.aio import cancel_and_wait
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.remote import RemoteEngine, default_metrics_url
from kvmeter.stats import EngineLoad, ReplicaHealth

__all__ = ["EnginePool"]

log = logging.getLogger(__name__)


class EnginePool(Engine):
    """Args:
        urls: the replicas' base URLs (≥ 1, distinct), vLLM servers of ``model_name``.
        model_dir: local directory with the served model's tokenizer.
        model_name: the served model.
        max_model_len: context window; default: the smallest the replicas report.
        api_key: bearer key for the replicas.
        timeout_s: per-read timeout.
        scrape: scrape each replica's ``<url>/metrics`` (False: health from connections and probes
            only, dispatch gated on request counts).
        scrape_interval_s: seconds between scrapes (> 0).
        probe_interval_s: seconds between probes of a down replica (> 0).
        bus: where loads and :class:`ReplicaHealth` go.
        clock: the injected clock (scrapes, probes).
    Raises:
        ValueError: no URL, a URL twice, or a non-positive interval.
    """

    def __init__(self, urls: Sequence[str], *, model_dir: str | Path, model_name: str,
                 max_model_len: int | None = None, api_key: str | None = None, timeout_s: float = 600.0,
                 scrape: bool = True, scrape_interval_s: float = 1.0, probe_interval_s: float = 5.0,
                 bus: StatsBus | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        names = [u.rstrip("/") for u in urls]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"an engine pool needs distinct replica URLs, got {list(urls)!r}")
        if not probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s!r}")
        self.model_name = model_name
        self.max_model_len = max_model_len or 0
        self.names: tuple[str, ...] = tuple(names)
        self._bus = bus
        self._clock = clock
        self.probe_interval_s = probe_interval_s
        self.replicas = [RemoteEngine(u, model_dir=model_dir, model_name=model_name, max_model_len=max_model_len,
                                      api_key=api_key, timeout_s=timeout_s,
                                      metrics_url=default_metrics_url(u) if scrape else None,
                                      scrape_interval_s=scrape_interval_s, bus=bus, clock=clock, replica=i,
                                      on_scrape=functools.partial(self._health, i))
                         for i, u in enumerate(names)]
        self.healthy = [True] * len(names)
        self.draining = [False] * len(names)
        self.reasons = [""] * len(names)
        self._started = [False] * len(names)
        self._next_probe = 0.0
        self._probe_task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def tokenizer(self) -> Tokenizer:
        for r, started in zip(self.replicas, self._started, strict=True):
            if started:
                return r.tokenizer
        raise EngineError("engine pool not started")

    def load(self) -> EngineLoad:
        """Replica 0's load (the :class:`Engine` contract); :meth:`loads` gives every replica's."""
        return self.replicas[0].load()

    def loads(self) -> list[EngineLoad]:
        """Each replica's load at its last scrape, by index."""
        return [r.load() for r in self.replicas]

    def available(self, idx: int) -> bool:
        """May replica ``idx`` take new requests (up and not draining)?"""
        return self.healthy[idx] and not self.draining[idx]

    def index_of(self, replica: int | str) -> int:
        """A replica's index from its index or URL. Raises KeyError for an unknown one."""
        if isinstance(replica, int):
            if 0 <= replica < len(self.replicas):
                return replica
        elif replica.rstrip("/") in self.names:
            return self.names.index(replica.rstrip("/"))
        raise KeyError(f"no replica {replica!r} in the pool ({', '.join(self.names)})")

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start every replica (concurrently); one that does not answer is down (probed later).

        Raises:
            EngineError: no replica answered (the first one's error, naming every replica's).
        """
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors: list[str] = []
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                if not isinstance(res, EngineError):
                    raise res
                errors.append(f"{self.names[i]}: {res}")
                self._health(i, False, str(res))
            else:
                self._started[i] = True
        if not any(self._started):
            raise EngineError("no replica of the engine pool answers: " + "; ".join(errors), retryable=True)
        lens = [r.max_model_len for r, s in zip(self.replicas, self._started, strict=True) if s and r.max_model_len]
        self.max_model_len = self.max_model_len or min(lens)
        self.publish_health()
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.create_task(self._probe_loop(), name="kvmeter-pool-probe")

    async def shutdown(self) -> None:
        task, self._probe_task = self._probe_task, None
        await cancel_and_wait(task)
        for r in self.replicas:
            await r.shutdown()

    async def abort(self, request_id: str) -> None:
        return None  # closing the response stream aborts upstream

    # ---------------------------------------------------------------- health and drain
    def _health(self, idx: int, ok: bool, why: str) -> None:
        if self.healthy[idx] == ok:
            return
        self.healthy[idx] = ok
        self.reasons[idx] = "" if ok else why
        if ok:
            log.info("engine pool: replica %s is up again", self.names[idx])
        else:
            log.warning("engine pool: replica %s is down (%s); no new requests go to it", self.names[idx], why)
        self._publish(idx)

    def mark_down(self, replica: int | str, why: str) -> None:
        """Replica ``replica`` (index or URL) failed (a connection, a broken stream): down until a
        scrape or a probe succeeds."""
        self._health(self.index_of(replica), False, why)

    def drain(self, replica: int | str, draining: bool = True) -> None:
        """Take replica ``replica`` (index or URL) out of routing (``draining=False``: back in);
        its running requests go on.

        Raises:
            KeyError: an unknown replica.
        """
        idx = self.index_of(replica)
        if self.draining[idx] != draining:
            self.draining[idx] = draining
            log.info("engine pool: replica %s %s", self.names[idx], "draining" if draining else "back in routing")
            self._publish(idx)

    def _publish(self, idx: int) -> None:
        if self._bus is not None:
            self._bus.publish(ReplicaHealth(model=self.model_name, replica=self.names[idx], index=idx,
                                            healthy=self.healthy[idx], draining=self.draining[idx],
                                            reason=self.reasons[idx]))

    def publish_health(self) -> None:
        """Publish every replica's :class:`ReplicaHealth` now (at start, and for a listener that
        came later)."""
        for i in range(len(self.replicas)):
            self._publish(i)

    async def probe(self, idx: int) -> bool:
        """Probe replica ``idx`` now (``GET /v1/models`` naming the pool's model; a replica that
        never started is started); marks it up on success.

        Returns:
            Did it answer?
        """
        r = self.replicas[idx]
        try:
            if not self._started[idx]:
                await r.start()
                self._started[idx] = True
                if not self.max_model_len:
                    self.max_model_len = r.max_model_len
            else:
                resp = await r.client.get("/v1/models", timeout=5.0)
                resp.raise_for_status()
                if self.model_name not in {m.get("id") for m in resp.json().get("data", [])}:
                    raise EngineError(f"{self.names[idx]} no longer serves {self.model_name!r}")
        except (httpx.HTTPError, ValueError, EngineError) as exc:
            self.reasons[idx] = f"probe: {exc}"
            return False
        self._health(idx, True, "")
        return True

    async def probe_down(self) -> None:
        """Probe every down replica once (what the background loop does every ``probe_interval_s``)."""
        self._next_probe = self._clock.monotonic() + self.probe_interval_s
        for i, ok in enumerate(list(self.healthy)):
            if not ok:
                await self.probe(i)

    async def _probe_loop(self) -> None:
        """Probe the down replicas whenever a probe is due on the injected clock (waking at least
        once a second)."""
        while True:
            await asyncio.sleep(min(self.probe_interval_s, 1.0))
            if self._clock.monotonic() >= self._next_probe and not all(self.healthy):
                await self.probe_down()

    # ---------------------------------------------------------------- requests
    async def open(self, path: str, content: bytes, headers: dict[str, str], replica: int = 0) -> httpx.Response:
        """:meth:`RemoteEngine.open` on replica ``replica``; a replica that cannot be reached is
        marked down before the error is raised (the caller fails over:
        :mod:`kvmeter.serving.gateway.remote_path`).

        Raises:
            EngineError: as :meth:`RemoteEngine.open` (retryable: not reached, nothing done).
        """
        try:
            return await self.replicas[replica].open(path, content, headers)
        except EngineError as exc:
            if exc.retryable:
                self.mark_down(replica, str(exc))
            raise

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """:meth:`RemoteEngine.generate` on the first available replica (the :class:`Engine`
        contract, for callers without a scheduler grant: tests, trace replays)."""
        idx = next((i for i in range(len(self.replicas)) if self.available(i) and self._started[i]), None)
        if idx is None:
            raise EngineError("no replica of the engine pool is available", retryable=True)
        async for out in self.replicas[idx].generate(request):
            yield out
