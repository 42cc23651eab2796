"""An external OpenAI-compatible server (e.g. ``vllm serve`` on GPUs) as kvmeter's engine.

**The gateway's path** is a transparent proxy (:mod:`kvmeter.serving.gateway.remote_path`): the
client's body goes to the upstream's own ``/v1/chat/completions`` or ``/v1/completions`` through
:meth:`RemoteEngine.open`, and the upstream's answer comes back to the client as it was sent. The
engine holds the connection pool, the upstream's API key, its tokenizer (kvmeter's count of a
prompt, for the quota's estimate) and its load.

:meth:`RemoteEngine.generate` (the :class:`~kvmeter.serving.engines.base.Engine` interface, for
callers that hand it token ids: tests, trace replays) sends the prompt as token ids to
``POST /v1/completions`` (vLLM's server accepts a token-id list), streaming with
``stream_options.include_usage`` so the usage chunk gives the server's engine-true counts (the
latest usage block wins; none ends the stream). ``min_tokens``/``ignore_eos`` are passed through
(vLLM extensions). Closing the stream closes the HTTP response, which a vLLM server turns into an
engine abort.

**Load.** The engine owns a :class:`~kvmeter.collectors.remote_vllm.RemoteVllmScraper` of its
upstream's Prometheus page (``metrics_url``; by default ``<base_url>/metrics``, where vLLM's OpenAI
server serves it on the API port). It scrapes once in :meth:`RemoteEngine.start`, then every
``scrape_interval_s`` (decided on the injected clock), the HTTP request and parsing on a worker
thread. After each scrape it publishes on the bus every :class:`~kvmeter.stats.RemoteEngineStats`
of the page (the exporters and the signal history read them) and the upstream's
:class:`~kvmeter.stats.EngineLoad` (:func:`upstream_load`: KV capacity from
``vllm:cache_config_info``, watermark from ``vllm:kv_cache_usage_perc``, running and waiting,
summed over the upstream's engines of the served model), which the serve runtime hands to the
scheduler's KV gating as it hands it the in-process engine's step stats. The load is a periodic
reading (``per_step=False``): between two scrapes the scheduler adds the prompts it dispatched
since to the watermark, and counts the engine's waiting queue from its own requests without a
first token.

Scraping is **on by default**: this engine already relies on vLLM's extensions
(``return_token_ids``, ``min_tokens``, ``ignore_eos``), so its upstream is a vLLM server. An
upstream that is not — its page answers 404 or holds no vLLM engine series before any scrape
succeeded — is logged once and no longer scraped: dispatch is then gated on request counts only.
``metrics_url=None`` (``engine.remote_metrics_url: off``) turns scraping off. While scrapes fail
(logged once per outage) the last load stands for ``STALE_INTERVALS`` intervals; after that the
engine reports its KV capacity unknown (count-only gating) rather than gate on a stale
watermark, until a scrape succeeds again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import AsyncGenerator, Callable, Sequence

import httpx

from kvmeter.aio import cancel_and_wait
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.collectors.remote_vllm import RemoteVllmScraper, ScrapeError
from kvmeter.serving.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Tokenizer
from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
from kvmeter.stats import EngineLoad, RemoteEngineStats

__all__ = ["RemoteEngine", "default_metrics_url", "upstream_load", "STALE_INTERVALS"]

log = logging.getLogger(__name__)

#: Scrape intervals the last load stands while scrapes fail; then the capacity is reported unknown.
STALE_INTERVALS = 3


def default_metrics_url(base_url: str) -> str:
    """The upstream's Prometheus page: ``<base_url>/metrics`` (vLLM's OpenAI server serves it on
    its API port)."""
    return base_url.rstrip("/") + "/metrics"


def upstream_load(stats: Sequence[RemoteEngineStats], model_name: str) -> EngineLoad | None:
    """The load of one upstream server from one scrape, for the scheduler's gating.

    The page's engines (``engine`` label: vLLM's data-parallel ranks) labelled with ``model_name``
    — all of them when none is — count as one engine: capacity = Σ KV blocks × block size (tokens),
    watermark = Σ (watermark × capacity) / capacity, running and waiting summed. When an engine's
    page has no ``vllm:cache_config_info`` the capacity is unknown (0) and the watermark is the
    fullest engine's (which still closes the gate at ``kv_watermark_high``); when an engine's KV
    usage is missing or invalid there is no KV reading at all (watermark 0, capacity 0).

    Returns:
        An :class:`EngineLoad` with ``per_step=False``; None if the page held no engine.
    """
    mine = [s for s in stats if s.model_name == model_name] or list(stats)
    if not mine:
        return None
    running = sum(int(s.num_running or 0) for s in mine)
    waiting = sum(int(s.num_waiting or 0) for s in mine)
    ratios = [s.kv_cache_usage_ratio for s in mine if s.kv_cache_usage_ratio is not None]
    if len(ratios) < len(mine):  # an engine without a KV reading
        return EngineLoad(0.0, 0, running, waiting, per_step=False)
    capacities = [(s.kv_blocks_total or 0) * (s.kv_block_size_tokens or 0) for s in mine]
    if all(capacities):
        capacity = sum(capacities)
        if len(ratios) == 1:
            ratio = ratios[0]
        else:
            ratio = sum(r * c for r, c in zip(ratios, capacities, strict=True)) / capacity
        return EngineLoad(min(1.0, ratio), capacity, running, waiting, per_step=False)
    return EngineLoad(max(ratios), 0, running, waiting, per_step=False)


class RemoteEngine(Engine):
    """Args:
        base_url: the server, e.g. ``http://gpu-node:8000``.
        model_dir: local directory with the served model's tokenizer (and config.json).
        model_name: the model name the server serves (and kvmeter's clients use).
        max_model_len: context window; default: the server's ``/v1/models`` ``max_model_len``.
        api_key: bearer key for the upstream, if it needs one (sent to its ``/metrics`` too).
        timeout_s: per-read timeout.
        metrics_url: the upstream's Prometheus page; ``""`` (default): :func:`default_metrics_url`
            of ``base_url``; None: not scraped (dispatch gated on request counts only).
        scrape_interval_s: seconds between scrapes (> 0), on ``clock``.
        bus: where each scrape's :class:`RemoteEngineStats` and :class:`EngineLoad` go (None: the
            load is only kept for :meth:`load`).
        clock: decides when a scrape is due; the scraper's rates and timestamps.
        replica: its index in an engine pool (:mod:`kvmeter.serving.engines.pool`): the
            published loads carry it (0 alone).
        on_scrape: told after each scrape whether it succeeded, and why not (an engine pool's
            health: a replica whose page does not answer is down); None: nobody.
    Raises:
        ValueError: if ``scrape_interval_s`` is not positive.
    """

    def __init__(self, base_url: str, *, model_dir: str | Path, model_name: str,
                 max_model_len: int | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, metrics_url: str | None = "", scrape_interval_s: float = 1.0,
                 bus: StatsBus | None = None, clock: Clock = SYSTEM_CLOCK, replica: int = 0,
                 on_scrape: Callable[[bool, str], None] | None = None) -> None:
        if not scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s must be > 0, got {scrape_interval_s!r}")
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.max_model_len = max_model_len or 0
        self._model_dir = model_dir
        self._tokenizer: HFTokenizer | None = None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                         timeout=httpx.Timeout(timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=1024,
                                                             max_keepalive_connections=256))
        self.replica = replica
        self._on_scrape = on_scrape
        self._load = EngineLoad(replica=replica, model=model_name)
        self.metrics_url = default_metrics_url(self.base_url) if metrics_url == "" else metrics_url
        self.scrape_interval_s = scrape_interval_s
        self._bus = bus
        self._clock = clock
        self._scrape_client: httpx.Client | None = None
        self._scraper: RemoteVllmScraper | None = None
        if self.metrics_url is not None:
            self._scrape_client = httpx.Client(timeout=5.0, headers=headers)
            self._scraper = RemoteVllmScraper(self.metrics_url, client=self._scrape_client, clock=clock)
        self._scrape_task: asyncio.Task[None] | None = None
        self._scrape_lock = asyncio.Lock()
        self._next_scrape = 0.0
        self._last_ok: float | None = None
        self._failing = False
        self._stale_reported = False

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("engine not started")
        return self._tokenizer

    @property
    def client(self) -> httpx.AsyncClient:
        """The connection pool to the upstream (its base URL set, its API key sent)."""
        return self._client

    @property
    def scraping(self) -> bool:
        """Is the upstream's ``/metrics`` scraped (off when not configured or not vLLM)?"""
        return self._scraper is not None

    async def start(self) -> None:
        self._tokenizer = HFTokenizer(self._model_dir)
        try:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            models = {m["id"]: m for m in resp.json().get("data", [])}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise EngineError(f"remote engine {self.base_url} is not answering /v1/models: {exc}",
                              retryable=True) from exc
        if self.model_name not in models:
            raise EngineError(f"remote engine serves {sorted(models)}, not {self.model_name!r}")
        if not self.max_model_len:
            self.max_model_len = int(models[self.model_name].get("max_model_len") or 0)
        if not self.max_model_len:
            raise EngineError("remote engine did not report max_model_len; set engine.max_model_len")
        if self._scraper is not None:
            await self.scrape()  # the load is known before the first request
        if self._scraper is not None and (self._scrape_task is None or self._scrape_task.done()):
            self._scrape_task = asyncio.create_task(self._scrape_loop(), name="kvmeter-remote-scrape")

    async def shutdown(self) -> None:
        task, self._scrape_task = self._scrape_task, None
        await cancel_and_wait(task)
        async with self._scrape_lock:  # a scrape on its worker thread still uses the client
            self._scraper = None
            if self._scrape_client is not None:
                self._scrape_client.close()
        await self._client.aclose()

    async def abort(self, request_id: str) -> None:
        return None  # closing the response stream aborts upstream

    def load(self) -> EngineLoad:
        """The upstream's load at the last scrape (an empty load while none succeeded)."""
        return self._load

    # ---------------------------------------------------------------- the upstream's /metrics
    async def scrape(self) -> EngineLoad | None:
        """Scrape the upstream's ``/metrics`` now and publish what it holds (see the module
        docstring).

        Returns:
            The new load; None when scraping is off, the page held no engine, or the scrape failed
            (logged, never raised: serving goes on with the last load).
        """
        async with self._scrape_lock:
            scraper = self._scraper
            if scraper is None:
                return None
            now = self._clock.monotonic()
            self._next_scrape = now + self.scrape_interval_s
            try:
                stats = await asyncio.to_thread(scraper.scrape)
            except ScrapeError as exc:
                if exc.status_code == 404 and self._last_ok is None:
                    self._not_vllm(f"{self.metrics_url} answered 404")
                else:
                    self._failed(exc, now)
                    if self._on_scrape is not None:
                        self._on_scrape(False, f"{self.metrics_url}: {exc}")
                return None
            if self._on_scrape is not None:
                self._on_scrape(True, "")
            load = upstream_load(stats, self.model_name)
            if load is None and self._last_ok is None:
                self._not_vllm(f"{self.metrics_url} holds no vLLM engine series")
                return None
            if self._failing:
                log.info("remote engine: %s answers again", self.metrics_url)
            self._failing = self._stale_reported = False
            self._last_ok = now
            bus = self._bus
            if bus is not None:
                for s in stats:
                    bus.publish(s)
            if load is None:
                return None
            load.replica, load.model = self.replica, self.model_name
            self._load = load
            if bus is not None:
                bus.publish(load)
            return load

    def _not_vllm(self, why: str) -> None:
        log.warning("remote engine: %s, so it is not scraped (not a vLLM server?): dispatch to it is gated "
                    "on request counts only, not its KV load. Set engine.remote_metrics_url to its vLLM "
                    "/metrics page, or to off.", why)
        self._scraper = None
        if self._scrape_client is not None:
            self._scrape_client.close()

    def _failed(self, exc: ScrapeError, now: float) -> None:
        if not self._failing:
            log.warning("remote engine: cannot read the upstream's load (%s); retrying every %.1f s",
                        exc, self.scrape_interval_s)
            self._failing = True
        stale = self._last_ok is None or now - self._last_ok >= STALE_INTERVALS * self.scrape_interval_s
        if stale and not self._stale_reported and (self._load.kv_capacity_tokens or self._load.kv_watermark_ratio):
            # a watermark this old would gate on a state long gone: report no KV reading instead
            self._load = EngineLoad(0.0, 0, self._load.num_running, self._load.num_waiting, per_step=False,
                                    replica=self.replica, model=self.model_name)
            self._stale_reported = True
            if self._bus is not None:
                self._bus.publish(self._load)

    async def _scrape_loop(self) -> None:
        """Scrape whenever one is due on the injected clock (waking at least once a second)."""
        while self._scraper is not None:
            await asyncio.sleep(min(self.scrape_interval_s, 1.0))
            if self._clock.monotonic() >= self._next_scrape:
                await self.scrape()

    async def open(self, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        """``POST`` ``content`` to the upstream's ``path`` (``/v1/chat/completions``, ...): the
        transparent proxy's request (:mod:`kvmeter.serving.gateway.remote_path`).

        Returns:
            The response, its headers read and its body not: read or stream it, then ``aclose()``
            it (closing it before its end closes the connection, which a vLLM server turns into
            an engine abort).
        Raises:
            EngineError: retryable when no connection could be made (refused, name resolution,
                connect or pool timeout); not retryable when the connection broke, or timed out,
                before the answer's headers.
        """
        request = self._client.build_request("POST", path, content=content, headers=headers)
        try:
            return await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise EngineError(f"the upstream {self.base_url} is unreachable ({type(exc).__name__}: {exc})",
                              retryable=True) from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"the upstream {self.base_url} failed before answering "
                              f"({type(exc).__name__}: {exc})") from exc

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        body = {"model": self.model_name, "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}  # vLLM extension: exact per-chunk token ids
        if request.min_tokens:
            body["min_tokens"] = request.min_tokens
        if request.ignore_eos:
            body["ignore_eos"] = True
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.priority:
            body["priority"] = request.priority
        input_tokens = len(request.prompt_token_ids)
        generated = 0
        finish: str | None = None
        final: EngineOutput | None = None
        try:
            async with self._client.stream("POST", "/v1/completions", json=body,
                                           headers={"x-request-id": request.request_id}) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise EngineError(f"remote engine answered {resp.status_code}: {detail}",
                                      retryable=resp.status_code >= 500)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        # read the stream to its end (``[DONE]``): a response closed before its
                        # body is fully read closes the connection instead of returning it to
                        # the pool, and every request would open a new TCP connection
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text", "")
                        ids = choice.get("token_ids")
                        # Exact with vLLM's return_token_ids; otherwise an estimate by re-tokenizing
                        # (only used for an aborted stream: a finished one bills the usage chunk).
                        new = len(ids) if ids is not None else (len(self.tokenizer.encode(text)) if text else 0)
                        generated += new
                        finish = choice.get("finish_reason") or finish
                        yield EngineOutput(new_token_ids=ids if ids is not None else (0,) * new, new_text=text,
                                           num_output_tokens=generated, num_input_tokens=input_tokens)
                    usage = chunk.get("usage")
                    if usage:  # the server's own counts; the latest block wins (none ends the stream)
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        final = EngineOutput(new_token_ids=(), new_text="",
                                             num_output_tokens=int(usage["completion_tokens"]),
                                             num_input_tokens=int(usage["prompt_tokens"]),
                                             num_cached_input_tokens=int(cached), finished=True)
        except httpx.HTTPError as exc:
            raise EngineError(f"remote engine failed: {type(exc).__name__}: {exc}", retryable=True) from exc
        if final is None:
            if finish is None:
                raise EngineError("remote engine stream ended without a finish_reason or a usage chunk")
            # a finished stream without usage: the counts streamed (exact with return_token_ids)
            final = EngineOutput(new_token_ids=(), new_text="", num_output_tokens=generated,
                                 num_input_tokens=input_tokens, finished=True)
        final.finish_reason = finish or "stop"
        yield final
