"""Scrape a vLLM server kvmeter does not host: parse its ``/metrics`` into plain engine stats
(:class:`~kvmeter.stats.RemoteEngineStats`). The remote engine
(:class:`~kvmeter.serving.engines.remote.RemoteEngine`) owns one scraper for its upstream.

Parsing uses prometheus-client's text parser. What this module adds is vLLM knowledge:

* **Names across versions.** V1 names (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``,
  ``vllm:inter_token_latency_seconds``) and V0 / deprecated ones (``vllm:gpu_cache_usage_perc``,
  ``vllm:time_per_output_token_seconds``, ``vllm:gpu_prefix_cache_hit_rate``) map to one canonical
  set; when both spellings are present the current one wins, and the aliases seen are reported.
* **Several engines.** Series are grouped by the ``model_name`` and ``engine`` labels.
* **Counters, properly.** ``<name>_total`` is the value; ``<name>_created`` is the counter's start
  time and is never added to anything. Between two scrapes a counter's delta is its increase; a
  decrease is a **reset** only with evidence — a newer ``_created``, or a newer
  ``process_start_time_seconds`` — and then the delta is the new value. Any other decrease (or a
  NaN, infinite or negative value) is **invalid**: it is reported, not counted, and the previous
  value stays the baseline.
* **Histograms.** Buckets, sum and count (``_created`` excluded); the window between two scrapes
  is the bucket-wise difference; quantiles are interpolated within buckets the way Prometheus'
  ``histogram_quantile`` does. A histogram without a ``+Inf`` bucket or ``_count`` (a truncated
  exposition) has an unknown count: its quantiles are ``None``, never guessed.

Timing uses the injected clock: rates are ``delta / (monotonic now − monotonic at last scrape)``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.stats.remote import CounterAnomaly, HistogramSnapshot, RemoteEngineStats

__all__ = [
    "ScrapeError",
    "CounterValue",
    "EngineSeries",
    "VllmExposition",
    "parse_vllm_metrics",
    "RemoteVllmScraper",
    "QUANTILES",
]

#: Quantiles computed for every latency window.
QUANTILES = (0.5, 0.9, 0.99)


class ScrapeError(Exception):
    """A /metrics endpoint could not be fetched or its text is not a Prometheus exposition.

    Attributes:
        status_code: the HTTP status when the server answered with one other than 200, else None.
    """

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


# --------------------------------------------------------------------------------------------
# vLLM names → canonical names

_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # deprecated alias (V0, hidden in V1)
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_swapped": "num_swapped",  # V0 only
    "vllm:gpu_prefix_cache_hit_rate": "prefix_cache_hit_rate",  # V0; -1 means disabled
}
_COUNTERS = {  # family names as the parser yields them (without "_total")
    "vllm:prompt_tokens": "input_tokens",
    "vllm:generation_tokens": "output_tokens",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_cache_queries_tokens",
    "vllm:prefix_cache_hits": "prefix_cache_hits_tokens",
    "vllm:request_success": "request_success",
}
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:time_per_output_token_seconds": "itl",  # V0 name / deprecated V1 alias
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:request_decode_time_seconds": "decode",
    "vllm:request_inference_time_seconds": "inference",
    "vllm:iteration_tokens_total": "iteration_tokens",
}
_PREFERRED = {  # when both spellings exist, keep the current one
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "itl": "vllm:inter_token_latency_seconds",
}
_DEPRECATED = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}
_ENGINE_LABELS = ("model_name", "engine")


# --------------------------------------------------------------------------------------------
# plain records


@dataclass(slots=True)
class CounterValue:
    """A counter's value and its ``_created`` start time (epoch seconds, ``None`` if absent)."""

    value: float
    created: float | None = None


@dataclass(slots=True)
class EngineSeries:
    """Everything one engine (``model_name`` × ``engine``) exposed in one scrape (cumulative).

    Attributes:
        model_name, engine: the labels ("" / "0" when absent).
        gauges: canonical gauge name → value (``kv_cache_usage`` is 0.0–1.0).
        counters: canonical counter name (``request_success:<finished_reason>`` for the
            per-reason counter) → :class:`CounterValue`.
        histograms: canonical name (``ttft``, ``itl``, ``e2e``, ``queue``, ``prefill``, ``decode``,
            ``inference``, ``tpot``, ``iteration_tokens``) → :class:`HistogramSnapshot`.
        kv_blocks_total, kv_block_size_tokens: from ``vllm:cache_config_info`` (``None`` if absent).
        sources: canonical name → the vLLM metric name it was read from.
    """

    model_name: str
    engine: str
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, CounterValue] = field(default_factory=dict)
    histograms: dict[str, HistogramSnapshot] = field(default_factory=dict)
    kv_blocks_total: int | None = None
    kv_block_size_tokens: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class VllmExposition:
    """One parsed vLLM /metrics page.

    Attributes:
        engines: keyed by ``(model_name, engine)``.
        process_start_time: ``process_start_time_seconds`` (epoch seconds) if exposed.
        deprecated_names: deprecated vLLM metric names present in the page.
    """

    engines: dict[tuple[str, str], EngineSeries] = field(default_factory=dict)
    process_start_time: float | None = None
    deprecated_names: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------------------------
# parsing


def _engine_key(labels: dict[str, str]) -> tuple[str, str]:
    return (labels.get("model_name", ""), labels.get("engine", "0"))


def _extra(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Labels other than the engine's (e.g. ``finished_reason``), sorted."""
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _ENGINE_LABELS and k != "le"))


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def parse_vllm_metrics(text: str) -> VllmExposition:
    """Parse a vLLM /metrics page (V0 or V1, any number of engines).

    Raises:
        ScrapeError: if the text is not a Prometheus text exposition.
    """
    out = VllmExposition()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:  # prometheus-client raises ValueError on malformed lines
        raise ScrapeError(f"not a Prometheus text exposition: {exc}") from exc
    hist_parts: dict[tuple[str, tuple[str, str]], dict] = {}
    configs: dict[tuple[str | None, str | None], tuple[int | None, int | None]] = {}
    created: dict[tuple[str, tuple[str, str], tuple], float] = {}
    counter_idents: dict[tuple[tuple[str, str], str], tuple] = {}
    for fam in families:
        if fam.name == "process_start_time_seconds" and fam.samples:
            out.process_start_time = float(fam.samples[0].value)
        if fam.name in _DEPRECATED:
            out.deprecated_names.add(fam.name)
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                configs[(s.labels.get("model_name"), s.labels.get("engine"))] = (
                    int(blocks) if blocks.isdigit() else None, int(size) if size.isdigit() else None)
        elif fam.name in _GAUGES:
            canonical = _GAUGES[fam.name]
            for s in fam.samples:
                key = _engine_key(s.labels)
                eng = out.engines.setdefault(key, EngineSeries(*key))
                if canonical in eng.gauges and eng.sources.get(canonical) == _PREFERRED.get(canonical):
                    continue  # the current name already gave this value
                eng.gauges[canonical] = float(s.value)
                eng.sources[canonical] = fam.name
        elif fam.name.endswith("_created") and fam.name.removesuffix("_created") in _COUNTERS | _HISTOGRAMS:
            # text format 0.0.4 writes a counter's start time as a separate "<name>_created"
            # gauge family (OpenMetrics puts it inside the family): a timestamp, never a value
            for s in fam.samples:
                created[(fam.name.removesuffix("_created"), _engine_key(s.labels), _extra(s.labels))] = float(s.value)
        elif fam.name in _COUNTERS:
            canonical = _COUNTERS[fam.name]
            for s in fam.samples:
                ident = (fam.name, _engine_key(s.labels), _extra(s.labels))
                if s.name.endswith("_created"):
                    created[ident] = float(s.value)  # OpenMetrics: a start time, never summed
                elif s.name.endswith("_total"):
                    key, extra = ident[1], ident[2]
                    eng = out.engines.setdefault(key, EngineSeries(*key))
                    name = canonical
                    if canonical == "request_success":
                        name = f"request_success:{dict(extra).get('finished_reason', '')}"
                    eng.counters[name] = CounterValue(float(s.value))
                    eng.sources[name] = fam.name
                    counter_idents[(key, name)] = ident
        elif fam.name in _HISTOGRAMS:
            canonical = _HISTOGRAMS[fam.name]
            for s in fam.samples:
                key = _engine_key(s.labels)
                part = hist_parts.setdefault((fam.name, key), {"buckets": {}, "sum": None,
                                                               "count": None, "created": None})
                if s.name.endswith("_bucket"):
                    part["buckets"][float(s.labels["le"])] = float(s.value)
                elif s.name.endswith("_sum"):
                    part["sum"] = float(s.value)
                elif s.name.endswith("_count"):
                    part["count"] = float(s.value)
                elif s.name.endswith("_created"):
                    created[(fam.name, key, ())] = float(s.value)
    for (key, name), ident in counter_idents.items():
        out.engines[key].counters[name].created = created.get(ident)
    for (name, key), part in hist_parts.items():
        part["created"] = created.get((name, key, ()))
        canonical = _HISTOGRAMS[name]
        eng = out.engines.setdefault(key, EngineSeries(*key))
        if canonical in eng.histograms and eng.sources.get(canonical) == _PREFERRED.get(canonical):
            continue
        buckets = sorted(part["buckets"].items())
        count = part["count"]
        if buckets and buckets[-1][0] == math.inf:
            count = buckets[-1][1] if count is None else count
        elif count is not None:
            buckets.append((math.inf, count))
        eng.histograms[canonical] = HistogramSnapshot(buckets, part["sum"], count, part["created"])
        eng.sources[canonical] = name
    # cache_config_info carries no model_name on V0 and no engine label before V1: match loosely
    for (model, engine), eng in out.engines.items():
        for cfg_key in ((model, engine), (model, None), (None, engine), (None, None)):
            if cfg_key in configs:
                eng.kv_blocks_total, eng.kv_block_size_tokens = configs[cfg_key]
                break
    return out


# --------------------------------------------------------------------------------------------
# scraping and deltas


def _series_name(name: str, key: tuple[str, str]) -> str:
    return f'{name}{{model_name="{key[0]}",engine="{key[1]}"}}'


class RemoteVllmScraper:
    """Scrape one vLLM ``/metrics`` URL and turn successive pages into :class:`RemoteEngineStats`.

    Args:
        url: the metrics URL, e.g. ``http://10.0.0.7:8000/metrics``.
        client: an ``httpx.Client`` to reuse (default: one owned by the scraper).
        clock: monotonic time for rates, wall time for timestamps.
        bus: if given, every :class:`RemoteEngineStats` is published on it.
        timeout_s: HTTP timeout in seconds.
    """

    def __init__(self, url: str, *, client: httpx.Client | None = None, clock: Clock = SYSTEM_CLOCK,
                 bus: StatsBus | None = None, timeout_s: float = 5.0) -> None:
        self.url = url
        self._client = client
        self._owns_client = client is None
        self._clock = clock
        self._bus = bus
        self._timeout_s = timeout_s
        self._prev: VllmExposition | None = None
        self._prev_mono: float | None = None
        self.last_exposition: VllmExposition | None = None

    def close(self) -> None:
        """Close the HTTP client if the scraper created it."""
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    def fetch(self) -> str:
        """GET the URL and return its text.

        Raises:
            ScrapeError: on a transport error or a non-200 status.
        """
        if self._client is None:
            self._client = httpx.Client(timeout=self._timeout_s)
        try:
            resp = self._client.get(self.url, headers={"Accept": "text/plain"})
        except httpx.HTTPError as exc:
            raise ScrapeError(f"cannot scrape {self.url}: {exc}") from exc
        if resp.status_code != 200:
            raise ScrapeError(f"{self.url} answered HTTP {resp.status_code}", status_code=resp.status_code)
        return resp.text

    def scrape(self) -> list[RemoteEngineStats]:
        """Fetch, parse and diff against the previous scrape.

        Raises:
            ScrapeError: fetch or parse failure (the previous baseline is kept).
        """
        return self.ingest(self.fetch())

    def ingest(self, text: str) -> list[RemoteEngineStats]:
        """Parse ``text`` as this source's next page and diff it against the previous one."""
        page = parse_vllm_metrics(text)
        now_mono, now_wall = self._clock.monotonic(), self._clock.wall()
        prev = self._prev
        interval = None if self._prev_mono is None else now_mono - self._prev_mono
        restarted = (prev is not None and page.process_start_time is not None
                     and prev.process_start_time is not None
                     and page.process_start_time > prev.process_start_time)
        results = []
        for key, eng in page.engines.items():
            old = prev.engines.get(key) if prev is not None else None
            results.append(self._engine_stats(eng, old, now_wall, interval, restarted))
        # a series judged invalid keeps its old baseline, so the next scrape diffs against it
        baseline = page
        invalid = [(s, a) for s in results for a in s.anomalies if a.kind == "invalid"]
        if prev is not None and invalid:
            baseline = copy.deepcopy(page)
            for stats, a in invalid:
                self._keep_old(baseline, prev, (stats.model_name, stats.engine), a.series)
        self._prev, self._prev_mono, self.last_exposition = baseline, now_mono, page
        if self._bus is not None:
            for stats in results:
                self._bus.publish(stats)
        return results

    @staticmethod
    def _keep_old(page: VllmExposition, prev: VllmExposition, key: tuple[str, str], series: str) -> None:
        name = series.split("{", 1)[0]
        old, new = prev.engines.get(key), page.engines.get(key)
        if old is None or new is None:
            return
        if name in old.counters:
            new.counters[name] = old.counters[name]
        elif name in old.histograms:
            new.histograms[name] = old.histograms[name]

    def _engine_stats(self, eng: EngineSeries, old: EngineSeries | None, now_wall: float,
                      interval: float | None, restarted: bool) -> RemoteEngineStats:
        key = (eng.model_name, eng.engine)
        st = RemoteEngineStats(source=self.url, model_name=eng.model_name, engine=eng.engine,
                               wall_ts=now_wall, interval_s=interval,
                               kv_blocks_total=eng.kv_blocks_total,
                               kv_block_size_tokens=eng.kv_block_size_tokens)
        kv = eng.gauges.get("kv_cache_usage")
        st.kv_cache_usage_ratio = kv if kv is not None and _finite(kv) and 0.0 <= kv <= 1.0 else None
        for name in ("num_running", "num_waiting", "num_swapped"):
            value = eng.gauges.get(name)
            setattr(st, name, value if value is not None and _finite(value) and value >= 0 else None)
        hit = eng.gauges.get("prefix_cache_hit_rate")
        st.prefix_cache_hit_rate = hit if hit is not None and 0.0 <= hit <= 1.0 else None  # -1: disabled
        for name, cur in eng.counters.items():
            if not _finite(cur.value) or cur.value < 0:
                st.anomalies.append(CounterAnomaly(_series_name(name, key), math.nan, cur.value,
                                                   "invalid", "not a finite, non-negative number"))
                continue
            before = old.counters.get(name) if old is not None else None
            if before is None:
                continue
            delta = self._counter_delta(_series_name(name, key), before.value, cur.value,
                                        before.created, cur.created, restarted, st.anomalies)
            if delta is not None:
                st.deltas[name] = delta
                if interval:
                    st.rates_per_s[name] = delta / interval
        for name, hist in eng.histograms.items():
            prev = old.histograms.get(name) if old is not None else None
            window = hist if prev is None else self._histogram_window(
                _series_name(name, key), prev, hist, restarted, st.anomalies)
            if window is None:
                continue
            st.windows[name] = window
            st.quantiles[name] = {q: window.quantile(q) for q in QUANTILES}
        return st

    @staticmethod
    def _is_reset(prev_created: float | None, cur_created: float | None, restarted: bool) -> str | None:
        if prev_created is not None and cur_created is not None and cur_created > prev_created:
            return "newer _created"
        if restarted:
            return "process restarted (newer process_start_time_seconds)"
        return None

    def _counter_delta(self, series: str, prev: float, cur: float, prev_created: float | None,
                       cur_created: float | None, restarted: bool,
                       anomalies: list[CounterAnomaly]) -> float | None:
        reset = self._is_reset(prev_created, cur_created, restarted)
        if reset is not None:  # the counter restarted from 0: all of its value is new
            anomalies.append(CounterAnomaly(series, prev, cur, "reset", reset))
            return cur
        if cur >= prev:
            return cur - prev
        anomalies.append(CounterAnomaly(series, prev, cur, "invalid",
                                        "decreased without a newer _created or process restart"))
        return None

    def _histogram_window(self, series: str, before: HistogramSnapshot, cur: HistogramSnapshot,
                          restarted: bool, anomalies: list[CounterAnomaly]) -> HistogramSnapshot | None:
        reset = self._is_reset(before.created, cur.created, restarted)
        prev_n = before.count if before.count is not None else (before.sum or 0.0)
        cur_n = cur.count if cur.count is not None else (cur.sum or 0.0)
        if reset is not None:
            anomalies.append(CounterAnomaly(series, prev_n, cur_n, "reset", reset))
            return cur
        window = cur.minus(before)
        if window is None:
            anomalies.append(CounterAnomaly(series, prev_n, cur_n, "invalid",
                                            "histogram decreased or changed buckets without a reset"))
        return window
