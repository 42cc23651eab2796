"""The router: which replica of an engine pool takes a dispatched request. One job: pick a replica.

The scheduler's core decides *which request* goes next (VTC, tiers, budgets) and *whether* some
replica may take one more (:func:`~.gating.open_engines`: each replica's own gate — running cap,
adaptive limit, waiting queue, KV watermark below ``kv_watermark_high`` of *its* capacity, which is
the per-replica KV budget). The router then picks *which* of the open replicas, by ``policy``:

* ``round_robin`` — the next open replica after the last one chosen, in index order.
* ``least_kv`` — the most free KV (:func:`~.gating.most_free_kv`, the choice the simulator's
  replicas have always had).
* ``prefix_aware`` (the default) — the highest score
  ``prefix_weight × hit − kv_weight × kv − queue_weight × queue`` where ``hit`` is the fraction of
  the request's prefix blocks the replica recently prefilled (:class:`PrefixIndex`, leading blocks
  only: a KV prefix cache reuses a prefix, never a middle), ``kv`` the replica's projected KV use
  ÷ its capacity (its watermark when the capacity is unknown; 0–1) and ``queue`` its waiting
  estimate ÷ ``max_engine_waiting`` (0–1). A tie goes to the most free KV, then the lowest index.
  With no hit anywhere it is a least-loaded choice; a hit outweighs a fuller cache or a longer
  queue up to the weights (defaults 1, 1, 1: a full hit is worth a full cache). Routing a shared prefix to the replica
  that holds it is what makes prefix caching pay across replicas (the SGLang router's
  cache-aware policy; Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for LLM
  Serving", ICLR 2025, score by the prefix match against the load).

A replica whose KV room cannot take the request's prompt is passed over while another can; the
prompt's blocks the replica recently prefilled (its :class:`PrefixIndex` match × ``block_tokens``)
are counted as cached there, not as new KV. (Counting a 7,200-token prompt whole when 6,000 of
it is the cached prefix passed the holder over as its KV filled: in the llm-d-shaped simulation,
``bench/fairness/scenario_llmd.py``, the 60 QPS step's hit ratio fell from 0.83 to 0.41 and its TTFT
p90 rose to 77 s.)

Every policy keeps the prefix index (recording each dispatched request's blocks against the
replica chosen), so each decision's outcome is comparable across policies: ``prefix_hit`` (the
chosen replica had recently prefilled at least the request's first block), ``prefix_miss`` (it
had not), ``no_prefix`` (the prompt is shorter than one block, or its tokens are unknown);
``failover`` for a request moved off a replica that failed before answering
(:meth:`~.core.SchedulerCore.reroute`). Each is reported to ``on_decision`` as a
:class:`~kvmeter.stats.RoutingDecision` (the exporter counts them in
``kvmeter_router_decisions_requests_total``).

**Prefix blocks** (:func:`prefix_block_hashes`): the prompt's token ids cut into ``block_size``
blocks (vLLM's KV block, 16 tokens by default), each block's hash chained on the previous one's,
as vLLM's prefix cache hashes them (:func:`kvmeter.tokens.prefix_block_hashes`, shared with the
re-prefill tracker) (the hash of a block names the whole prefix up to it). Only full
blocks, at most ``max_blocks`` of them (the index is approximate: the first blocks carry the
shared system prompt / conversation head that decides affinity).

The index is **approximate**: it knows what kvmeter sent where, not what each replica's cache
still holds. It forgets an entry after ``ttl_s`` on the injected clock (a replica's cache evicts
what is not reused) and keeps at most ``capacity_blocks`` entries (least recently used out first);
a replica that died or restarted is forgotten at once (:meth:`PrefixIndex.forget`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.stats import RoutingDecision
from kvmeter.tokens import prefix_block_hashes as _prefix_block_hashes

from .config import SchedulerConfig
from .gating import EngineGate, free_kv, most_free_kv

__all__ = ["RoutingPolicy", "ROUTING_POLICIES", "prefix_block_hashes", "PrefixIndex", "Route", "Router",
           "DEFAULT_BLOCK_SIZE"]

RoutingPolicy = Literal["prefix_aware", "least_kv", "round_robin"]
#: the policies, the default first
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicy)
#: tokens per prefix block (vLLM's default KV block size)
DEFAULT_BLOCK_SIZE = 16


def prefix_block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                        max_blocks: int = 64) -> tuple[int, ...]:
    """The router's prefix blocks: :func:`kvmeter.tokens.prefix_block_hashes` (the one definition)
    with the router's defaults — ``block_size`` 16 tokens, at most ``max_blocks`` 64 leading blocks.

    Raises:
        ValueError: if ``block_size`` < 1 or ``max_blocks`` < 0.
    """
    return _prefix_block_hashes(token_ids, block_size, max_blocks)


class PrefixIndex:
    """Which replica recently prefilled which prefix block: an LRU map of block hash → {replica:
    last time, monotonic seconds}.

    Args:
        capacity_blocks: most block hashes kept (≥ 1; least recently used out first).
        ttl_s: seconds (on ``clock``) after which a replica's entry for a block no longer counts (> 0).
        clock: the injected clock.
    Raises:
        ValueError: on a capacity < 1 or a ttl ≤ 0.
    """

    def __init__(self, capacity_blocks: int = 100_000, ttl_s: float = 600.0, clock: Clock = SYSTEM_CLOCK) -> None:
        if capacity_blocks < 1 or not ttl_s > 0:
            raise ValueError(f"capacity_blocks must be ≥ 1 and ttl_s > 0, got {capacity_blocks}, {ttl_s}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: OrderedDict[int, dict[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """Per replica, how many of the leading ``hashes`` it prefilled within ``ttl_s``
        (replicas with none are absent)."""
        now = self._clock.monotonic()
        out: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, h in enumerate(hashes):
            seen = self._blocks.get(h)
            if not seen:
                break
            fresh = {r for r, t in seen.items() if now - t < self.ttl_s}
            alive = fresh if alive is None else alive & fresh
            if not alive:
                break
            for r in alive:
                out[r] = depth + 1
        return out

    def record(self, hashes: Sequence[int], replica: int) -> None:
        """``replica`` prefilled the blocks ``hashes`` now."""
        now = self._clock.monotonic()
        blocks = self._blocks
        for h in hashes:
            seen = blocks.get(h)
            if seen is None:
                blocks[h] = {replica: now}
                if len(blocks) > self.capacity_blocks:
                    blocks.popitem(last=False)
            else:
                seen[replica] = now
                blocks.move_to_end(h)

    def forget(self, replica: int) -> None:
        """Drop every entry of ``replica`` (it died or restarted: its cache is gone)."""
        for h in [h for h, seen in self._blocks.items() if seen.pop(replica, None) is not None and not seen]:
            del self._blocks[h]


@dataclass(frozen=True, slots=True)
class Route:
    """A routing choice: the replica's gate, the decision's outcome (``prefix_hit``,
    ``prefix_miss``, ``no_prefix``, ``failover``) and the leading prefix blocks it holds."""

    engine: EngineGate
    outcome: str
    matched_blocks: int = 0


class Router:
    """Picks a replica among the open ones (see the module docstring).

    Args:
        policy: ``prefix_aware`` (default), ``least_kv`` or ``round_robin``.
        index: the prefix index (default: a new :class:`PrefixIndex` on ``clock``).
        clock: the injected clock (for the default index).
        prefix_weight, kv_weight, queue_weight: ``prefix_aware``'s score weights (≥ 0).
        model: the pool's model (the decisions' label).
        replica_names: each replica's name by index (its URL; the decisions' label).
        on_decision: told of every committed decision (the runtime publishes it on the bus).
        block_tokens: tokens per prefix block of the ``prefix`` hashes :meth:`choose` is given
            (≥ 1; :data:`DEFAULT_BLOCK_SIZE`, as :func:`prefix_block_hashes` cuts them; the
            simulator's trace hash groups otherwise).
    Raises:
        ValueError: on an unknown policy, a negative weight or ``block_tokens`` < 1.
    """

    def __init__(self, policy: str = "prefix_aware", *, index: PrefixIndex | None = None,
                 clock: Clock = SYSTEM_CLOCK, prefix_weight: float = 1.0, kv_weight: float = 1.0,
                 queue_weight: float = 1.0, model: str = "", replica_names: Sequence[str] = (),
                 on_decision: Callable[[RoutingDecision], None] | None = None,
                 block_tokens: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be ≥ 1, got {block_tokens}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if min(prefix_weight, kv_weight, queue_weight) < 0:
            raise ValueError("routing weights must be ≥ 0")
        self.policy = policy
        self.index = index or PrefixIndex(clock=clock)
        self.weights = (prefix_weight, kv_weight, queue_weight)
        self.model = model
        self.replica_names = tuple(replica_names)
        self.on_decision = on_decision
        self.block_tokens = block_tokens
        self._last = -1

    @staticmethod
    def kv_ratio(e: EngineGate) -> float:
        """The replica's KV use, 0–1: projected use ÷ capacity, or its watermark when the capacity
        is unknown."""
        if e.capacity:
            return min(1.0, max(0.0, e.projected_used() / e.capacity))
        return e.load.kv_watermark_ratio

    def score(self, e: EngineGate, hit: float, config: SchedulerConfig) -> float:
        """``prefix_aware``'s score of replica ``e`` for a request of which it holds the fraction
        ``hit`` (0–1) of the prefix blocks."""
        wp, wk, wq = self.weights
        queue = min(1.0, e.waiting_estimate() / max(1, config.max_engine_waiting))
        return wp * hit - wk * self.kv_ratio(e) - wq * queue

    def choose(self, candidates: Sequence[EngineGate], prefix: Sequence[int], config: SchedulerConfig,
               need_tokens: int = 0) -> Route:
        """The replica for a request, among ``candidates`` (open gates, not empty), whose prefix
        blocks are ``prefix`` and prompt ``need_tokens`` tokens. Pure: :meth:`commit` records it.

        Raises:
            ValueError: if ``candidates`` is empty.
        """
        if not candidates:
            raise ValueError("no replica to choose from")
        matched = self.index.match(prefix) if prefix else {}
        bt = self.block_tokens
        fits = [e for e in candidates
                if not e.capacity or e.projected_used() + max(0, need_tokens - matched.get(e.idx, 0) * bt)
                <= config.kv_watermark_high * e.capacity]
        pool = fits or list(candidates)
        if self.policy == "round_robin":
            after = [e for e in pool if e.idx > self._last]
            chosen = min(after or pool, key=lambda e: e.idx)
        elif self.policy == "least_kv":
            chosen = most_free_kv(pool) or pool[0]
        else:
            n = len(prefix) or 1
            chosen = max(pool, key=lambda e: (self.score(e, matched.get(e.idx, 0) / n, config), free_kv(e), -e.idx))
        got = matched.get(chosen.idx, 0)
        outcome = "no_prefix" if not prefix else ("prefix_hit" if got else "prefix_miss")
        return Route(chosen, outcome, got)

    def commit(self, route: Route, prefix: Sequence[int]) -> None:
        """The request went to ``route.engine``: remember its prefix there, report the decision."""
        self._last = route.engine.idx
        if prefix:
            self.index.record(prefix, route.engine.idx)
        if self.on_decision is not None:
            self.on_decision(RoutingDecision(model=self.model, policy=self.policy, outcome=route.outcome,
                                             replica=self.replica_name(route.engine.idx)))

    def replica_name(self, idx: int) -> str:
        """Replica ``idx``'s name (its URL), or its index as text."""
        return self.replica_names[idx] if idx < len(self.replica_names) else str(idx)
