"""One simulated replica behind the :class:`~kvmeter.serving.engines.base.Engine` boundary.

The gateway can run on :class:`SimEngine` exactly as on the vLLM engine: ``generate()`` streams
:class:`EngineOutput` deltas, ``load()`` feeds the scheduler's gating, and each step publishes an
:class:`~kvmeter.stats.EngineStepStats` on the bus with the fields the vLLM engine hooks fill (KV
use, running/waiting, scheduled/prompt/generation tokens with vLLM's meanings, TTFTs and ITLs:
:func:`~.steps.step_stats`) and, while anything subscribes to them, its
:class:`~kvmeter.stats.EngineStepShares` (:mod:`.steps`: per tenant, as the vLLM adapter), so
``bus.subscribe(EngineStepStats, fair_scheduler.on_step_stats)`` wires KV-watermark gating the same
way on both engines.

Time: steps take the roofline model's duration. With a :class:`~kvmeter.clock.ManualClock` the
engine advances that clock itself by each step's duration (virtual time: tests and demos run as fast
as the CPU allows); with a real clock it sleeps ``duration × time_scale``. The simulator has no
model: every request generates exactly ``max_tokens`` tokens (as a trace replay with
``ignore_eos``); token ids are placeholders and the text is empty.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncGenerator, Awaitable, Callable, Sequence

from kvmeter.aio import cancel_and_wait
from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock, ManualClock
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.stats import EngineLoad, EngineRequestStats, EngineStepShares, EngineStepStats
from kvmeter.tokens import TokenCounts

from .costmodel import RooflineCostModel
from .replica import FINISHED, SimReplica, SimRequest
from .steps import step_stats

__all__ = ["SimEngine", "ByteTokenizer"]

log = logging.getLogger(__name__)

#: Placeholder output token id (a space in :class:`ByteTokenizer`).
_TOKEN = 32


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids (0–255): a real, lossless tokenizer that needs no model files."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The text's UTF-8 bytes (this tokenizer has no special tokens to add)."""
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        parts = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
            parts.append(f"<|{m['role']}|>\n{m['content']}\n")
        parts.append("<|assistant|>\n")
        return self.encode("".join(parts))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 256


class _Stream:
    __slots__ = ("queue", "req", "sent", "arrival", "attribution")

    def __init__(self, req: SimRequest, arrival: float, attribution: Attribution) -> None:
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.req = req
        self.sent = 0
        self.arrival = arrival
        self.attribution = attribution


class SimEngine(Engine):
    """A simulated vLLM replica as an :class:`Engine`.

    Args:
        cost: the replica's cost model.
        clock: a :class:`ManualClock` (virtual time, advanced here) or a real clock.
        model_name: name clients use (default: the cost model's model name).
        bus: where :class:`EngineStepStats` go (None: nowhere).
        engine_idx: index reported in step stats.
        time_scale: real seconds slept per simulated second (real clocks only; > 0).
        sleep: the sleep coroutine (injectable).
        replica_kwargs: passed to :class:`SimReplica` (limits, scheduling policy, prefix caching).
    """

    def __init__(self, cost: RooflineCostModel, *, clock: Clock = SYSTEM_CLOCK, model_name: str | None = None,
                 bus: StatsBus | None = None, engine_idx: int = 0, time_scale: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, **replica_kwargs) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.cost = cost
        self.model_name = model_name or cost.model.name
        self.max_model_len = cost.model.max_model_len
        self._clock = clock
        self._manual: ManualClock | None = clock if isinstance(clock, ManualClock) else None  # virtual time
        self._bus = bus
        self._idx = engine_idx
        self._scale = time_scale
        self._sleep = sleep
        self._replica_kwargs = replica_kwargs
        self.replica = SimReplica(cost, idx=engine_idx, **replica_kwargs)
        self._tokenizer = ByteTokenizer()
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._prefix_q = 0
        self._prefix_h = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name=f"kvmeter-sim-engine-{self._idx}")

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for rid in list(self._streams):
            await self.abort(rid)

    def load(self) -> EngineLoad:
        return self.replica.load()

    async def abort(self, request_id: str) -> None:
        st = self._streams.pop(request_id, None)
        if st is None:
            return
        if self.replica.abort(st.req, self._clock.monotonic()):
            st.queue.put_nowait(self._output(st, finished=True, reason="abort"))

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        n_input = len(request.prompt_token_ids)
        if n_input < 1 or request.max_tokens < 1:
            raise EngineError("a request needs ≥ 1 prompt token and max_tokens ≥ 1")
        if n_input + request.max_tokens > self.max_model_len:
            raise EngineError(f"prompt ({n_input}) + max_tokens ({request.max_tokens}) exceeds the "
                              f"context window of {self.max_model_len} tokens")
        if request.request_id in self._streams:
            raise EngineError(f"request id {request.request_id!r} is already running")
        if self._task is None:
            raise EngineError("SimEngine.start() has not been awaited")
        req = SimRequest(request.request_id, n_input, request.max_tokens, priority=request.priority,
                         tenant_id=request.attribution.tenant_id, tier=request.attribution.tier)
        try:
            self.replica.add(req, self._clock.monotonic())
        except ValueError as err:
            raise EngineError(str(err)) from err
        st = _Stream(req, self._clock.monotonic(), request.attribution)
        self._streams[request.request_id] = st
        self._wake.set()
        finished = False
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request.request_id)

    # ---------------------------------------------------------------- the step loop
    def _output(self, st: _Stream, *, finished: bool = False, reason: str | None = None,
                stats: EngineRequestStats | None = None) -> EngineOutput:
        req = st.req
        n = self.replica.output_tokens(req) if req.state != FINISHED else req.out
        new = max(0, n - st.sent)
        st.sent = n
        return EngineOutput(new_token_ids=[_TOKEN] * new, new_text="", num_output_tokens=n,
                            num_input_tokens=req.input_tokens, num_cached_input_tokens=req.cached_tokens,
                            finished=finished, finish_reason=reason, stats=stats)

    async def _run(self) -> None:
        rep = self.replica
        while True:
            if not rep.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self._clock.monotonic()
            end = rep.plan(now, horizon=now)  # one step at a time: tokens stream per step
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            duration = end - now
            if self._manual is not None:
                await self._sleep(0)
                self._manual.advance(max(0.0, end - self._manual.monotonic()))
            else:
                await self._sleep(duration * self._scale)
            q0, h0 = rep.cache.queries_tokens, rep.cache.hits_tokens
            bus = self._bus  # each step's EngineStepShares, built only while someone listens
            rep.step_sink = bus.publish if bus is not None and bus.has_subscribers(EngineStepShares) else None
            rep.wall_offset_s = self._clock.wall() - self._clock.monotonic()
            out = rep.complete()
            self._deliver(out)
            self._publish(out, q0, h0)

    def _deliver(self, out) -> None:
        done = {id(r) for r in out.finished}
        for rid, st in list(self._streams.items()):
            req = st.req
            if id(req) in done:
                del self._streams[rid]
                st.queue.put_nowait(self._output(st, finished=True, reason="length", stats=self._stats(st)))
            elif req.state != FINISHED and (req.decoding or req.out > st.sent):
                o = self._output(st)
                if o.new_token_ids:
                    st.queue.put_nowait(o)

    def _stats(self, st: _Stream) -> EngineRequestStats:
        req = st.req
        finish = req.finish_s
        assert finish is not None, "stats are taken of a finished request"
        first = req.first_token_s if req.first_token_s is not None else finish
        n = req.out
        return EngineRequestStats(
            request_id=req.request_id, finish_reason="length",
            tokens=TokenCounts(input_tokens=req.input_tokens, cached_input_tokens=req.cached_tokens, output_tokens=n),
            queued_s=0.0, prefill_s=first - req.engine_arrival_s, decode_s=finish - first,
            inference_s=finish - req.engine_arrival_s, e2e_s=finish - st.arrival,
            mean_tpot_s=(finish - first) / (n - 1) if n > 1 else 0.0,
            preemptions=req.preemptions, wall_ts=self._clock.wall(), attribution=st.attribution)

    def _publish(self, out, q0: int, h0: int) -> None:
        bus = self._bus
        if bus is None or not bus.has_subscribers(EngineStepStats):
            return
        bus.publish(step_stats(self.replica, out, prefix_queries0=q0, prefix_hits0=h0, wall_ts=self._clock.wall()))
