"""One simulated vLLM replica: continuous batching at iteration granularity.

Per step (one engine iteration, Orca-style continuous batching, Yu et al., OSDI 2022):

1. every running request that is decoding gets one token (decode tokens are scheduled first,
   vLLM's chunked-prefill policy);
2. running requests still in prefill get a chunk each, in admission order, from the remaining
   token budget (``max_num_batched_tokens``), at most ``long_prefill_token_threshold`` each
   (chunked prefill, Agrawal et al., "Sarathi-Serve", OSDI 2024);
3. waiting requests are admitted — by ``(priority, arrival)`` with the ``priority`` policy, by
   arrival with ``fcfs`` — while the budget, ``max_num_seqs`` and the KV pool allow; a request's
   cached hash prefix is looked up on admission and skipped;
4. if the KV pool cannot hold the step's new blocks, running requests are preempted by
   *recompute* (vLLM V1: the victim is the running request with the largest
   ``(priority, arrival)``; its blocks are freed and it is re-queued to prefill its prompt and the
   tokens it already generated again).

The step's duration comes from :class:`~.costmodel.RooflineCostModel`. A prefill's last chunk
samples the first output token. Runs of identical decode-only steps (no prefill, no admission) are
advanced together (a "segment" of ``k`` steps) up to the next request finish, the next external
event (``horizon``) or the step where the KV pool would overflow — exact for a deterministic model,
and what makes an hour of trace simulate in seconds.

Time here is virtual seconds handed in by the caller; nothing reads a clock.

Why this module is longer than ~600 lines: :meth:`SimReplica.step` mirrors vLLM v1's one
``Scheduler.schedule`` pass (running requests first, then waiting ones, under one token budget
and one KV pool, with preemption), and the decode-segment fast path must keep exactly the same
rules; they are kept side by side so a change to one is seen against the other.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvmeter.stats import EngineLoad, EngineStepShares

from .costmodel import RooflineCostModel
from .kvcache import PrefixCache
from .steps import segment_shares

__all__ = ["SimRequest", "SimReplica", "StepOutcome", "WAITING", "RUNNING", "FINISHED"]

WAITING, RUNNING, FINISHED = 0, 1, 2
_MAX_SEGMENT_STEPS = 4096


class SimRequest:
    """A request inside the simulated engine.

    Args:
        request_id: unique id.
        input_tokens: prompt length (≥ 1).
        output_tokens: tokens it will generate (≥ 1; the simulator has no model, so a trace's
            output length is generated exactly, as a replay with ``ignore_eos`` does).
        priority: engine priority (lower runs first, preempted last).
        hash_ids: hash of each ``group_tokens`` block of the prompt (Mooncake), or None.
        tenant_id, tier: attribution (reports only).
        payload: anything the caller wants back (e.g. the scheduler grant).
    Raises:
        ValueError: on non-positive lengths.
    """

    __slots__ = ("request_id", "input_tokens", "target", "priority", "hashes", "tenant_id", "tier",
                 "payload", "state", "seq", "engine_arrival_s", "computed", "prefill_target", "out",
                 "out0", "slot", "decoding", "held", "next_group", "cached_tokens", "looked_up",
                 "first_token_s", "last_token_s", "finish_s", "preemptions", "spans", "span_start",
                 "gap_itls", "version", "charged")

    def __init__(self, request_id: str, input_tokens: int, output_tokens: int, *, priority: int = 0,
                 hash_ids: Sequence[int] | None = None, tenant_id: str = "", tier: str = "",
                 payload: Any = None) -> None:
        if input_tokens < 1 or output_tokens < 1:
            raise ValueError(f"request {request_id!r}: prompt and output lengths must be ≥ 1 "
                             f"(got {input_tokens}, {output_tokens})")
        self.request_id = request_id
        self.input_tokens = int(input_tokens)
        self.target = int(output_tokens)
        self.priority = int(priority)
        self.hashes: tuple[int, ...] = tuple(hash_ids) if hash_ids else ()
        self.tenant_id = tenant_id
        self.tier = tier
        self.payload = payload
        self.state = WAITING
        self.seq = 0
        self.engine_arrival_s = 0.0
        self.computed = 0
        self.prefill_target = self.input_tokens
        self.out = 0
        self.out0 = 0
        self.slot = -1
        self.decoding = False
        self.held: list[int] = []
        self.next_group = 0
        self.cached_tokens = 0
        self.looked_up = False
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.finish_s: float | None = None
        self.preemptions = 0
        self.spans: list[tuple[int, int]] = []
        self.span_start = -1
        self.gap_itls: list[float] = []
        self.version = 0
        self.charged = 0

    def engine_ttft_s(self) -> float:
        """Seconds from the engine's arrival to the first token (engine-side TTFT).

        Raises:
            ValueError: the request has no first token yet.
        """
        if self.first_token_s is None:
            raise ValueError(f"request {self.request_id!r} has no first token yet")
        return self.first_token_s - self.engine_arrival_s


@dataclass(slots=True)
class StepOutcome:
    """What one completed step (or segment of steps) produced.

    Attributes:
        end_s: virtual time the step ended.
        steps: engine iterations in the segment (≥ 1).
        duration_s: virtual seconds the segment took (all its steps).
        first_tokens: requests that produced their first token.
        finished: requests that generated their last token.
        preempted: requests preempted when the step was planned.
        prefill_tokens: prompt (or recompute) tokens computed in the segment — the prefill part
            of vLLM's scheduled tokens.
        decode_tokens: tokens generated by requests that were already decoding (one per request
            per step); each has an inter-token latency of its step's duration.
        generated_tokens: all output tokens generated (decode tokens + prefills that completed).
        itl_sum_s: sum of the inter-token latencies of the tokens generated after a request's
            first (decode tokens, and the first token after a preemption's recompute).
        itl_count: how many tokens ``itl_sum_s`` covers.
    """

    end_s: float
    steps: int
    duration_s: float = 0.0
    first_tokens: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0

    @property
    def scheduled_tokens(self) -> int:
        """Tokens the engine computed in the segment (prefill chunks + one per decoding request
        per step), vLLM's ``num_scheduled_tokens`` summed over the steps."""
        return self.prefill_tokens + self.decode_tokens


class SimReplica:
    """A discrete-event model of one vLLM replica (one TP group).

    Args:
        cost: step-time and capacity model.
        idx: replica index (reports).
        max_num_batched_tokens: token budget per step (default: the accelerator's).
        max_num_seqs: most running requests (default: the accelerator's).
        long_prefill_token_threshold: most prefill tokens one request gets per step (None: no cap).
        scheduling: ``priority`` (vLLM ``--scheduling-policy priority``) or ``fcfs``.
        enable_prefix_caching: look up and register hash groups.
        group_tokens: tokens per hash group of the trace (Mooncake: 512).
        step_sink: called with each step's :class:`~kvmeter.stats.EngineStepShares` as
            :meth:`complete` applies it (k records for a decode segment of k steps: :mod:`.steps`);
            None (the default): no records are built.
        wall_offset_s: epoch seconds at virtual 0, added to the records' ``wall_ts``.
    Raises:
        ValueError: on bad sizes or an unknown scheduling policy.
    """

    def __init__(self, cost: RooflineCostModel, *, idx: int = 0, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, long_prefill_token_threshold: int | None = None,
                 scheduling: str = "priority", enable_prefix_caching: bool = True,
                 group_tokens: int = 512, step_sink: Callable[[EngineStepShares], None] | None = None,
                 wall_offset_s: float = 0.0) -> None:
        if scheduling not in ("priority", "fcfs"):
            raise ValueError(f"scheduling must be 'priority' or 'fcfs', got {scheduling!r}")
        self.cost = cost
        self.idx = idx
        self.B = cost.block_size
        self.max_batched = int(max_num_batched_tokens or cost.accelerator.max_num_batched_tokens)
        self.max_seqs = int(max_num_seqs or cost.accelerator.max_num_seqs)
        if self.max_batched < 1 or self.max_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be ≥ 1")
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be ≥ 1 or None")
        self.threshold = long_prefill_token_threshold or self.max_batched
        self.priority_sched = scheduling == "priority"
        self.cache = PrefixCache(cost.num_kv_blocks, self.B, group_tokens, enable_prefix_caching)
        self.G = group_tokens
        n = self.max_seqs
        self._p0 = np.zeros(n, np.int64)    # private KV tokens at base step s0
        self._ctx0 = np.zeros(n, np.int64)  # all KV tokens at s0
        self._s0 = np.zeros(n, np.int64)
        self._dec = np.zeros(n, np.int64)   # 1 while decoding
        self._slot_req: list[SimRequest | None] = [None] * n
        self._free_slots = list(range(n - 1, -1, -1))
        self._waiting: list[tuple[int, int, SimRequest]] = []
        self.n_waiting = 0
        self._prefilling: list[SimRequest] = []
        self.n_running = 0
        self.n_dec = 0
        self._finish: list[tuple[int, int, int, SimRequest]] = []
        self._seq = itertools.count()
        self.S = 0
        self.now = 0.0
        self._pending: tuple[list, int, float] | None = None
        self._preempted: list[SimRequest] = []
        self._cum = np.zeros(0)
        self.busy_until: float | None = None
        self.seg_t: list[float] = []
        self.seg_k: list[int] = []
        self.preemptions_total = 0
        self.steps_total = 0
        self.input_tokens_computed = 0
        self.kv_watermark_integral = 0.0
        self.kv_watermark_max = 0.0
        self.busy_time = 0.0
        self.step_sink = step_sink
        self.wall_offset_s = float(wall_offset_s)

    # ------------------------------------------------------------------ queries
    @property
    def total_blocks(self) -> int:
        return self.cache.total_blocks

    def has_work(self) -> bool:
        return self.n_running > 0 or self.n_waiting > 0

    def _p_now(self) -> np.ndarray:
        return self._p0 + self._dec * (self.S - self._s0)

    def private_tokens(self) -> np.ndarray:
        """Private KV tokens of each slot now: an int64 array of length ``max_seqs``, 0 for a free
        slot (shared prefix groups are not counted; :attr:`cache` holds those)."""
        return self._p_now()

    def private_blocks(self) -> int:
        """Private KV blocks in use now (excludes shared groups)."""
        B = self.B
        return int(((self._p_now() + B - 1) // B).sum())

    def used_blocks(self) -> int:
        """KV blocks in use now (private + referenced shared groups)."""
        return self.private_blocks() + self.cache.used_shared_blocks

    def output_tokens(self, req: SimRequest) -> int:
        """Tokens ``req`` has generated so far."""
        if req.decoding:
            return req.out0 + self.S - int(self._s0[req.slot])
        return req.out

    def running_requests(self) -> list[SimRequest]:
        return [r for r in self._slot_req if r is not None]

    def planned_chunks(self) -> list[tuple[SimRequest, int]]:
        """The prefill chunks of the step :meth:`plan` planned and :meth:`complete` has not yet
        applied: ``(request, prefill tokens in this step)`` each, in scheduling order; ``[]``
        when no step is planned or the plan is a decode-only segment."""
        if self._pending is None:
            return []
        return [(req, c) for req, c, _ in self._pending[0]]

    def load(self) -> EngineLoad:
        """The replica's :class:`EngineLoad` (KV watermark excludes evictable cached groups)."""
        total = self.cache.total_blocks
        return EngineLoad(kv_watermark_ratio=min(1.0, self.used_blocks() / total),
                          kv_capacity_tokens=total * self.B, num_running=self.n_running,
                          num_waiting=self.n_waiting)

    # ------------------------------------------------------------------ intake
    def add(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` in the engine's waiting queue at virtual time ``now``.

        Raises:
            ValueError: if the request can never fit the KV pool (input + output > capacity).
        """
        if req.input_tokens + req.target > self.cache.total_blocks * self.B:
            raise ValueError(f"request {req.request_id!r} needs {req.input_tokens + req.target} KV "
                             f"tokens; the replica holds {self.cache.total_blocks * self.B}")
        req.seq = next(self._seq)
        req.engine_arrival_s = now
        req.state = WAITING
        self._push_waiting(req)

    def _push_waiting(self, req: SimRequest) -> None:
        prio = req.priority if self.priority_sched else 0
        heapq.heappush(self._waiting, (prio, req.seq, req))
        self.n_waiting += 1

    def abort(self, req: SimRequest, now: float) -> bool:
        """Remove ``req`` (waiting or running) without finishing it. Returns True if it was here."""
        if req.state == WAITING and req.slot == -1 and any(e[2] is req for e in self._waiting):
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
            self.n_waiting -= 1
            req.state = FINISHED
            req.finish_s = now
            return True
        if req.state == RUNNING:
            if req.decoding:
                req.out = self.output_tokens(req)
                self._close_span(req, len(self.seg_t) - 1)
            self._free(req)
            req.state = FINISHED
            req.finish_s = now
            return True
        return False

    # ------------------------------------------------------------------ planning
    def _victim(self) -> SimRequest | None:
        best = None
        for r in self._slot_req:
            if r is not None and (best is None or (r.priority if self.priority_sched else 0, r.seq) >
                                  (best.priority if self.priority_sched else 0, best.seq)):
                best = r
        return best

    def _close_span(self, req: SimRequest, last_seg: int) -> None:
        if req.span_start >= 0 and last_seg >= req.span_start:
            req.spans.append((req.span_start, last_seg))
        req.span_start = -1

    def _free(self, req: SimRequest) -> None:
        """Release a running request's slot and groups."""
        slot = req.slot
        for h in req.held:
            self.cache.release(h)
        req.held = []
        self._p0[slot] = self._ctx0[slot] = self._s0[slot] = self._dec[slot] = 0
        self._slot_req[slot] = None
        self._free_slots.append(slot)
        req.slot = -1
        self.n_running -= 1
        if req.decoding:
            self.n_dec -= 1
            req.decoding = False
            req.version += 1
        else:
            try:
                self._prefilling.remove(req)
            except ValueError:
                pass

    def _preempt(self, req: SimRequest, now: float) -> None:
        if req.decoding:
            req.out = self.output_tokens(req)
            req.last_token_s = now
            self._close_span(req, len(self.seg_t) - 1)
        self._free(req)
        req.state = WAITING
        req.computed = 0
        req.next_group = 0
        req.looked_up = False
        req.prefill_target = req.input_tokens + req.out
        req.preemptions += 1
        self.preemptions_total += 1
        self._push_waiting(req)

    def plan(self, now: float, horizon: float = float("inf")) -> float | None:
        """Plan the next step (or decode-only segment) starting at ``now``; returns its end time,
        or None when there is nothing to run. A decode-only segment stops at the first step
        boundary at or after ``horizon`` (the caller's next external event).

        Raises:
            RuntimeError: if a step is already planned and not completed.
        """
        if self._pending is not None:
            raise RuntimeError("plan() called twice without complete()")
        self.now = max(self.now, now)
        B, cache = self.B, self.cache
        p = self._p_now()
        blocks = (p + B - 1) // B
        priv_blocks = int(blocks.sum())
        budget = self.max_batched - self.n_dec
        grow = (self._dec == 1) & (p % B == 0)
        need = int(np.count_nonzero(grow))
        chunks: list[list] = []  # [req, tokens, new_blocks]
        for req in self._prefilling:
            if budget <= 0:
                break
            c = min(req.prefill_target - req.computed, self.threshold, budget)
            pr = int(p[req.slot])
            nb = -(-(pr + c) // B) - (-(-pr // B))
            chunks.append([req, c, nb])
            need += nb
            budget -= c
        preempted: list[SimRequest] = []
        alloc = cache.allocatable_blocks(priv_blocks)
        while need > alloc:
            victim = self._victim()
            if victim is None:
                break
            slot = victim.slot
            pv = int(p[slot])
            if victim.decoding:
                if pv % B == 0:
                    need -= 1
                budget += 1
            else:
                for ch in chunks:
                    if ch[0] is victim:
                        need -= ch[2]
                        budget += ch[1]
                        chunks.remove(ch)
                        break
            priv_blocks -= -(-pv // B)
            p[slot] = 0
            self._preempt(victim, self.now)
            preempted.append(victim)
            alloc = cache.allocatable_blocks(priv_blocks)
        # admissions from the waiting queue
        while budget > 0 and self.n_waiting and self.n_running < self.max_seqs:
            prio, seq, req = self._waiting[0]
            start = 0
            hits = 0
            revive = 0
            if req.hashes and cache.enabled:
                n_full = min(len(req.hashes), req.input_tokens // self.G)
                hits = cache.cached_prefix(req.hashes[:n_full])
                hits = min(hits, (req.prefill_target - 1) // self.G)
                start = hits * self.G
                revive = cache.revive_blocks(req.hashes[:hits])
            c = min(req.prefill_target - start, self.threshold, budget)
            nb = -(-c // B)
            if need + nb + revive > alloc:
                break
            heapq.heappop(self._waiting)
            self.n_waiting -= 1
            for h in req.hashes[:hits]:
                cache.acquire(h)
            req.held = list(req.hashes[:hits])
            req.next_group = hits
            if not req.looked_up:
                req.looked_up = True
                if req.preemptions == 0:
                    cache.queries_tokens += req.input_tokens
                    cache.hits_tokens += start
                    req.cached_tokens = start
            req.computed = start
            slot = self._free_slots.pop()
            req.slot = slot
            self._slot_req[slot] = req
            self._p0[slot] = 0
            self._ctx0[slot] = start
            self._s0[slot] = self.S
            self._dec[slot] = 0
            req.state = RUNNING
            req.decoding = False
            self._prefilling.append(req)
            self.n_running += 1
            chunks.append([req, c, nb])
            need += nb
            budget -= c
            alloc -= revive
        if not chunks and self.n_dec == 0:
            if preempted:  # everything was preempted and nothing fits: should not happen
                raise RuntimeError("KV pool cannot hold a single request")
            return None
        p = self._p_now()
        ctx_dec = int((self._dec * (self._ctx0 + self.S - self._s0)).sum())
        if chunks:
            if not cache.make_room(priv_blocks, need):
                raise RuntimeError("KV accounting error: planned step does not fit")
            t = self.cost.step_time(self.n_dec, ctx_dec, [(r.computed, c) for r, c, _ in chunks])
            self._pending = (chunks, 1, t)
            self._preempted = preempted
            self.busy_until = self.now + t
            return self.busy_until
        # decode-only segment
        n = self.n_dec
        k_fin = _MAX_SEGMENT_STEPS
        fin = self._finish
        while fin:
            s_fin, _, ver, r = fin[0]
            if ver != r.version or not r.decoding:
                heapq.heappop(fin)
                continue
            k_fin = min(k_fin, max(1, s_fin - self.S))
            break
        dec = self._dec
        base = (p + B - 1) // B

        def need_k(k: int) -> int:
            return int(((p + dec * k + B - 1) // B - base).sum())

        k_max = k_fin
        if need_k(k_max) > alloc:
            lo, hi = 1, k_max  # need_k(1) ≤ alloc was ensured above
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if need_k(mid) <= alloc:
                    lo = mid
                else:
                    hi = mid - 1
            k_max = lo
        times = self.cost.decode_step_times(n, ctx_dec, k_max)
        cum = np.cumsum(times)
        k = k_max
        if horizon < float("inf"):
            k = min(k_max, int(np.searchsorted(cum, horizon - self.now, side="left")) + 1)
        total = float(cum[k - 1])
        self._cum = cum
        if not cache.make_room(priv_blocks, need_k(k)):
            raise RuntimeError("KV accounting error: decode segment does not fit")
        self._pending = ([], k, total)
        self._preempted = preempted
        self.busy_until = self.now + total
        return self.busy_until

    def truncate(self, now: float) -> None:
        """Cut a planned decode-only segment at its first step boundary at or after ``now`` (new
        work was queued for this replica and must join the next step)."""
        if self._pending is None:
            return
        chunks, k, _total = self._pending
        if chunks or k <= 1:
            return
        k2 = min(k, int(np.searchsorted(self._cum, now - self.now, side="left")) + 1)
        if k2 < k:
            total = float(self._cum[k2 - 1])
            self._pending = (chunks, k2, total)
            self.busy_until = self.now + total

    # ------------------------------------------------------------------ completion
    def complete(self) -> StepOutcome:
        """Apply the planned step at its end time; returns what it produced.

        Raises:
            RuntimeError: if no step is planned.
        """
        if self._pending is None:
            raise RuntimeError("complete() without a planned step")
        chunks, k, total = self._pending
        self._pending = None
        start = self.now
        end = self.now + total
        sink = self.step_sink
        if sink is not None:
            ends = [end] if chunks else (start + self._cum[:k]).tolist()
            for shares in segment_shares(self, [(r, c) for r, c, _ in chunks], k, ends,
                                         wall_offset_s=self.wall_offset_s):
                sink(shares)
        j = len(self.seg_t)
        self.seg_t.append(total / k)
        self.seg_k.append(k)
        ratio_before = self.used_blocks() / self.cache.total_blocks
        self.S += k
        self.now = end
        self.busy_until = None
        self.steps_total += k
        self.busy_time += total
        n_dec = self.n_dec
        out = StepOutcome(end_s=end, steps=k, duration_s=total, preempted=self._preempted,
                          decode_tokens=n_dec * k, generated_tokens=n_dec * k, itl_sum_s=n_dec * total,
                          itl_count=n_dec * k)
        self._preempted = []
        G = self.G
        for req, c, _nb in chunks:
            slot = req.slot
            out.prefill_tokens += c
            req.computed += c
            self.input_tokens_computed += c
            self._p0[slot] += c
            self._ctx0[slot] += c
            n_full = min(len(req.hashes), req.input_tokens // G)
            while req.next_group < n_full and (req.next_group + 1) * G <= req.computed:
                h = req.hashes[req.next_group]
                if self.cache.register(h):
                    req.held.append(h)
                    self._p0[slot] -= G
                req.next_group += 1
            if req.computed >= req.prefill_target:
                self._prefilling.remove(req)
                req.out += 1
                out.generated_tokens += 1
                if req.first_token_s is None:
                    req.first_token_s = end
                    out.first_tokens.append(req)
                else:
                    req.gap_itls.append(end - req.last_token_s)
                    out.itl_sum_s += end - req.last_token_s
                    out.itl_count += 1
                req.last_token_s = end
                if req.out >= req.target:
                    self._finish_req(req, end, out)
                else:
                    req.decoding = True
                    self.n_dec += 1
                    self._dec[slot] = 1
                    self._s0[slot] = self.S
                    req.out0 = req.out
                    req.span_start = j + 1
                    heapq.heappush(self._finish, (self.S + req.target - req.out, req.seq, req.version, req))
        fin = self._finish
        while fin and fin[0][0] <= self.S:
            _, _, ver, req = heapq.heappop(fin)
            if ver != req.version or not req.decoding:
                continue
            req.out = req.target
            req.last_token_s = end
            self._close_span(req, j)
            self._finish_req(req, end, out)
        ratio_after = self.used_blocks() / self.cache.total_blocks
        self.kv_watermark_integral += 0.5 * (ratio_before + ratio_after) * (end - start)
        self.kv_watermark_max = max(self.kv_watermark_max, ratio_before, ratio_after)
        return out

    def _finish_req(self, req: SimRequest, end: float, out: StepOutcome) -> None:
        self._free(req)
        req.state = FINISHED
        req.finish_s = end
        out.finished.append(req)
