"""OpenTelemetry export of kvmeter's request metrics and traces, in the GenAI semantic conventions.

From each :class:`~kvmeter.stats.RequestCompletion` on the bus:

metrics (OpenTelemetry GenAI semantic conventions, "Generative AI metrics"):

* ``gen_ai.client.token.usage`` — histogram, ``{token}``, one point per token type
  (``gen_ai.token.type`` = ``input`` / ``output``);
* ``gen_ai.server.time_to_first_token`` — histogram, ``s`` (requests that produced a token);
* ``gen_ai.server.time_per_output_token`` — histogram, ``s``: (E2E − TTFT) / (output tokens − 1),
  for successful requests with at least two output tokens;
* ``gen_ai.server.request.duration`` — histogram, ``s``, with ``error.type`` on failed or
  aborted requests;

with attributes ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.provider.name`` and
kvmeter's bounded ``kvmeter.tier``. ``gen_ai.operation.name`` follows the endpoint, with the
semantic conventions' values: ``chat`` for ``/v1/chat/completions``, ``text_completion`` for
``/v1/completions``. **Tenant ids never go on metric attributes** (unbounded cardinality); they go
on spans:

* one span per request, ``{gen_ai.operation.name} {model}`` (kind SERVER), from arrival to end
  (wall clock), carrying ``gen_ai.usage.input_tokens`` / ``output_tokens`` /
  ``cache_read.input_tokens``, ``gen_ai.request.model``, ``gen_ai.operation.name``,
  ``gen_ai.response.id`` (the answer's ``id``, when known), ``gen_ai.response.model`` (the served
  model that answered), ``gen_ai.response.finish_reasons`` (one per choice, as the answer sent them:
  ``tool_calls`` where vLLM's layer, or a remote upstream, answered it though the engine stopped
  with ``stop``; the engine's reason for a choice the answer did not finish),
  ``kvmeter.tenant.id``, ``kvmeter.tier``, ``kvmeter.outcome``, ``kvmeter.slo_met``, the TTFT and
  queue time, and an ERROR status with ``error.type`` for failed requests;
* the request's phases (:class:`~kvmeter.stats.RequestPhase`) as span events in order, each at the
  time its phase began, with its length in ``kvmeter.duration_s``: ``kvmeter.queue`` (gateway
  queue and the engine's waiting queue), ``kvmeter.prefill`` (to the first token),
  ``kvmeter.decode`` (to the last token);
* **joining the caller's trace:** a request that came with a W3C ``traceparent`` (and
  ``tracestate``) header gets its span as a child of the caller's span, in the caller's trace,
  read by OpenTelemetry's own :class:`~opentelemetry.trace.propagation.tracecontext.TraceContextTextMapPropagator`
  (W3C Trace Context level 1). A malformed or absent ``traceparent`` starts a new root trace
  (never an error). The SDK's default sampler (parent-based, ``OTEL_TRACES_SAMPLER``) follows the
  caller's sampled flag: a caller that sent ``-00`` (not sampled) gets no span exported.

Configuration is the standard OpenTelemetry environment: ``OTEL_SDK_DISABLED``,
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the
per-signal ``..._METRICS_ENDPOINT`` / ``..._TRACES_ENDPOINT``), ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` only), ``OTEL_METRICS_EXPORTER`` /
``OTEL_TRACES_EXPORTER`` (``otlp`` or ``none``), ``OTEL_METRIC_EXPORT_INTERVAL``. The SDK reads
them; this module only builds the providers and refuses settings it cannot honour. Export runs on
the SDK's own threads; a failing collector is logged and retried by the SDK, never raised into
serving.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from kvmeter.bus import StatsBus
from kvmeter.stats import RequestCompletion

__all__ = ["OtelExporter", "install_otel", "GENAI_PROVIDER", "GENAI_OPERATIONS", "TOKEN_USAGE_BUCKETS",
           "TTFT_BUCKETS", "TPOT_BUCKETS", "DURATION_BUCKETS"]

log = logging.getLogger(__name__)

# Names from the OpenTelemetry GenAI semantic conventions (gen-ai-metrics.md, gen-ai-spans.md).
_TOKEN_USAGE = "gen_ai.client.token.usage"
_TTFT = "gen_ai.server.time_to_first_token"
_TPOT = "gen_ai.server.time_per_output_token"
_DURATION = "gen_ai.server.request.duration"
_OPERATION = "gen_ai.operation.name"
_PROVIDER = "gen_ai.provider.name"
_REQUEST_MODEL = "gen_ai.request.model"
_TOKEN_TYPE = "gen_ai.token.type"
_USAGE_INPUT = "gen_ai.usage.input_tokens"
_USAGE_OUTPUT = "gen_ai.usage.output_tokens"
_USAGE_CACHED = "gen_ai.usage.cache_read.input_tokens"
_RESPONSE_ID = "gen_ai.response.id"
_RESPONSE_MODEL = "gen_ai.response.model"
_FINISH_REASONS = "gen_ai.response.finish_reasons"
_ERROR_TYPE = "error.type"

#: ``gen_ai.provider.name`` value: kvmeter serves vLLM engines
GENAI_PROVIDER = "vllm"

#: ``gen_ai.operation.name`` of each endpoint (the semantic conventions' well-known values)
GENAI_OPERATIONS = {"chat.completions": "chat", "completions": "text_completion"}

_PROPAGATOR = TraceContextTextMapPropagator()

# Explicit bucket boundaries advised by the semantic conventions for each instrument.
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                       16777216, 67108864)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)

_NS = 1_000_000_000


@dataclass
class OtelExporter:
    """Maps :class:`RequestCompletion` to GenAI metrics and spans.

    Args:
        meter_provider, tracer_provider: the providers (SDK ones in practice; tests pass ones
            with an ``InMemoryMetricReader`` / ``InMemorySpanExporter``).
        operation: ``gen_ai.operation.name`` of a completion whose attribution names no endpoint
            of :data:`GENAI_OPERATIONS` (the others get their endpoint's).
    """

    meter_provider: MeterProvider
    tracer_provider: TracerProvider
    operation: str = "chat"

    def __post_init__(self) -> None:
        meter = self.meter_provider.get_meter("kvmeter.exporters.otel")
        self._tracer = self.tracer_provider.get_tracer("kvmeter.exporters.otel")
        self._tokens = meter.create_histogram(
            _TOKEN_USAGE, unit="{token}", description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS)
        self._ttft = meter.create_histogram(
            _TTFT, unit="s", description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self._tpot = meter.create_histogram(
            _TPOT, unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self._duration = meter.create_histogram(
            _DURATION, unit="s", description="Generative AI server request duration.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self._unsubscribe: list = []

    def attach(self, bus: StatsBus) -> "OtelExporter":
        """Subscribe to ``RequestCompletion`` on ``bus``; returns self."""
        self._unsubscribe.append(bus.subscribe(RequestCompletion, self.on_completion))
        return self

    def on_completion(self, c: RequestCompletion) -> None:
        """Record one finished request as metric points and one span."""
        operation = GENAI_OPERATIONS.get(c.attribution.endpoint, self.operation)
        attrs = {_OPERATION: operation, _PROVIDER: GENAI_PROVIDER,
                 _REQUEST_MODEL: c.attribution.model, "kvmeter.tier": c.attribution.tier}
        ok = c.outcome == "ok"
        error_type = None if ok else ("aborted" if c.outcome == "aborted" else "error")
        output = c.tokens.output_tokens
        self._tokens.record(c.tokens.input_tokens, {**attrs, _TOKEN_TYPE: "input"})
        self._tokens.record(output, {**attrs, _TOKEN_TYPE: "output"})
        if c.ttft_s is not None and ok:
            self._ttft.record(c.ttft_s, attrs)
        if ok and c.ttft_s is not None and output >= 2:
            self._tpot.record(max(0.0, c.e2e_s - c.ttft_s) / (output - 1), attrs)
        self._duration.record(c.e2e_s, attrs if ok else {**attrs, _ERROR_TYPE: error_type})
        self._span(c, operation, error_type)

    def _span(self, c: RequestCompletion, operation: str, error_type: str | None) -> None:
        end_ns = int(c.wall_ts * _NS)
        start_ns = end_ns - int(max(c.e2e_s, 0.0) * _NS)
        a, tokens = c.attribution, c.tokens
        span_attrs: dict[str, AttributeValue] = {
            _OPERATION: operation, _PROVIDER: GENAI_PROVIDER, _REQUEST_MODEL: a.model,
            _RESPONSE_MODEL: a.model, _FINISH_REASONS: list(c.finish_reasons),
            _USAGE_INPUT: tokens.input_tokens, _USAGE_OUTPUT: tokens.output_tokens,
            _USAGE_CACHED: tokens.cached_input_tokens,
            "kvmeter.tenant.id": a.tenant_id, "kvmeter.tier": a.tier, "kvmeter.outcome": c.outcome,
            "kvmeter.queue_s": c.queue_s,
        }
        if c.response_id:
            span_attrs[_RESPONSE_ID] = c.response_id
        if c.ttft_s is not None:
            span_attrs["kvmeter.ttft_s"] = c.ttft_s
        if c.slo_met is not None:
            span_attrs["kvmeter.slo_met"] = c.slo_met
        if error_type is not None:
            span_attrs[_ERROR_TYPE] = error_type
        span = self._tracer.start_span(f"{operation} {a.model}", context=_caller_context(c.trace_headers),
                                       kind=SpanKind.SERVER, attributes=span_attrs, start_time=start_ns)
        for phase in c.phases:
            span.add_event(f"kvmeter.{phase.name}", {"kvmeter.duration_s": phase.end_s - phase.start_s},
                           timestamp=start_ns + int(phase.start_s * _NS))
        if error_type is not None:
            span.set_status(Status(StatusCode.ERROR, c.outcome))
        span.end(end_time=end_ns)

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export everything recorded so far (SDK providers only); True on success."""
        ok = True
        for provider in (self.meter_provider, self.tracer_provider):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                ok = bool(flush(timeout_millis)) and ok
        return ok

    def close(self) -> None:
        """Unsubscribe, flush and shut the providers down."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        for provider in (self.meter_provider, self.tracer_provider):
            shutdown = getattr(provider, "shutdown", None)
            if shutdown is not None:
                shutdown()


def _caller_context(headers: Sequence[tuple[str, str]]) -> Context:
    """The caller's span as the parent context of a request's span, from its W3C
    ``traceparent`` / ``tracestate`` headers (``(name, value)`` pairs as received); an empty
    context (a new root trace) when there is none or ``traceparent`` is malformed. Never the
    current context: the span's parent is the caller's, not whatever runs the exporter."""
    if not headers:
        return Context()
    carrier: dict[str, list[str]] = {}
    for name, value in headers:
        carrier.setdefault(name.lower(), []).append(value)
    return _PROPAGATOR.extract(carrier, context=Context())


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


def install_otel(bus: StatsBus, *, meter_provider: MeterProvider | None = None,
                 tracer_provider: TracerProvider | None = None,
                 env: Mapping[str, str] | None = None) -> OtelExporter | None:
    """Build OTLP/HTTP providers from the ``OTEL_*`` environment and subscribe to ``bus``.

    Args:
        bus: the stats bus.
        meter_provider, tracer_provider: use these instead of building from the environment.
        env: the environment to read (default ``os.environ``; the OTLP exporters themselves
            always read ``os.environ`` for endpoints and headers).
    Returns:
        The exporter, or ``None`` when ``OTEL_SDK_DISABLED=true`` or both
        ``OTEL_METRICS_EXPORTER`` and ``OTEL_TRACES_EXPORTER`` are ``none``.
    Raises:
        ValueError: for an ``OTEL_EXPORTER_OTLP_PROTOCOL`` other than ``http/protobuf`` or an
            exporter name other than ``otlp`` / ``none``.
    """
    env = os.environ if env is None else env
    if _env_flag(env, "OTEL_SDK_DISABLED"):
        return None
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        protocol = env.get(var, "http/protobuf").strip()
        if protocol != "http/protobuf":
            raise ValueError(f"{var}={protocol!r}: kvmeter exports OTLP over http/protobuf only")
    kinds = {}
    for var in ("OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER"):
        kind = env.get(var, "otlp").strip().lower()
        if kind not in ("otlp", "none"):
            raise ValueError(f"{var}={kind!r}: kvmeter supports 'otlp' or 'none'")
        kinds[var] = kind
    if (meter_provider is None and tracer_provider is None
            and kinds["OTEL_METRICS_EXPORTER"] == kinds["OTEL_TRACES_EXPORTER"] == "none"):
        return None
    # SDK imports only when OTel export is really wanted
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kvmeter"}))
    if meter_provider is None:
        readers = []
        if kinds["OTEL_METRICS_EXPORTER"] == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        meter_provider = SdkMeterProvider(resource=resource, metric_readers=readers)
    if tracer_provider is None:
        tracer_provider = SdkTracerProvider(resource=resource)
        if kinds["OTEL_TRACES_EXPORTER"] == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return OtelExporter(meter_provider, tracer_provider).attach(bus)
