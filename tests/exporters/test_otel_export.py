"""OpenTelemetry export in the GenAI semantic conventions: checked with the SDK's in-memory reader
and span exporter, and end to end against a real OTLP/HTTP receiver on loopback that decodes the
protobuf with opentelemetry-proto."""

from __future__ import annotations

import gzip
import threading
import time

import pytest
import uvicorn
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvmeter.attribution import Attribution
from kvmeter.exporters.otel import install_otel
from kvmeter.stats import RequestCompletion, RequestPhase
from kvmeter.tokens import TokenCounts


def completion(tenant="acme", outcome="ok", prompt=1200, cached=512, out=101, ttft=0.4, e2e=4.4, endpoint="", **kw):
    return RequestCompletion(
        attribution=Attribution(tenant, tier="paid_interactive", model="smollm2", endpoint=endpoint),
        tokens=TokenCounts(input_tokens=prompt, cached_input_tokens=cached, output_tokens=out),
        outcome=outcome,
        ttft_s=ttft,
        e2e_s=e2e,
        queue_s=0.05,
        slo_met=True,
        wall_ts=1750000100.0,
        **kw,
    )


@pytest.fixture
def in_memory(bus):
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    exporter = install_otel(bus, meter_provider=MeterProvider(metric_readers=[reader]),
                            tracer_provider=tracer_provider)
    yield reader, spans
    exporter.close()


def points(reader) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def test_genai_metrics(bus, in_memory):
    reader, _ = in_memory
    bus.publish(completion(tenant="acme"))
    bus.publish(completion(tenant="globex", prompt=300, cached=0, out=1, ttft=0.2, e2e=0.2))
    got = points(reader)
    usage = {p.attributes["gen_ai.token.type"]: p for p in got["gen_ai.client.token.usage"]}
    assert usage["input"].sum == 1500 and usage["input"].count == 2
    assert usage["output"].sum == 102
    assert sum(p.count for p in got["gen_ai.server.time_to_first_token"]) == 2
    assert sum(p.sum for p in got["gen_ai.server.time_to_first_token"]) == pytest.approx(0.6)
    (tpot,) = got["gen_ai.server.time_per_output_token"]  # globex had one token: no TPOT
    assert tpot.count == 1 and tpot.sum == pytest.approx((4.4 - 0.4) / 100)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.count == 2 and duration.sum == pytest.approx(4.6)
    attrs = dict(usage["input"].attributes)
    assert attrs == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vllm",
                     "gen_ai.request.model": "smollm2", "kvmeter.tier": "paid_interactive",
                     "gen_ai.token.type": "input"}


def test_tenant_ids_never_on_metric_attributes(bus, in_memory):
    reader, _ = in_memory
    for i in range(50):
        bus.publish(completion(tenant=f"tenant-{i}"))
    for name, pts in points(reader).items():
        for p in pts:
            assert not any("tenant" in k for k in p.attributes), name
            assert "tenant-" not in " ".join(map(str, p.attributes.values())), name
        assert len(pts) <= 2, f"{name}: tenants must not multiply metric streams"


def test_spans_carry_usage_and_tenant(bus, in_memory):
    _, spans = in_memory
    bus.publish(completion())
    (span,) = spans.get_finished_spans()
    assert span.name == "chat smollm2" and span.kind == SpanKind.SERVER
    a = span.attributes
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
            a["gen_ai.usage.cache_read.input_tokens"]) == (1200, 101, 512)
    assert a["gen_ai.request.model"] == "smollm2" and a["gen_ai.operation.name"] == "chat"
    assert a["kvmeter.tenant.id"] == "acme" and a["kvmeter.tier"] == "paid_interactive"
    assert a["kvmeter.ttft_s"] == 0.4 and a["kvmeter.slo_met"] is True
    assert span.end_time == 1_750_000_100 * 10**9
    assert span.end_time - span.start_time == pytest.approx(4.4e9, abs=1e3)
    assert span.status.status_code == StatusCode.UNSET


def test_failed_and_aborted_requests(bus, in_memory):
    reader, spans = in_memory
    bus.publish(completion(outcome="error", out=0, ttft=None, e2e=0.3))
    bus.publish(completion(outcome="aborted", out=40, e2e=2.0))
    got = points(reader)
    assert "gen_ai.server.time_to_first_token" not in got  # only successful responses
    assert "gen_ai.server.time_per_output_token" not in got
    errors = {p.attributes.get("error.type"): p.count for p in got["gen_ai.server.request.duration"]}
    assert errors == {"error": 1, "aborted": 1}
    by_outcome = {s.attributes["kvmeter.outcome"]: s for s in spans.get_finished_spans()}
    assert by_outcome["error"].status.status_code == StatusCode.ERROR
    assert by_outcome["aborted"].attributes["error.type"] == "aborted"
    assert by_outcome["aborted"].attributes["gen_ai.usage.output_tokens"] == 40  # work done is reported


# -- the caller's trace, the response, the phases --------------------------------------------------

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
PHASES = (RequestPhase("queue", 0.0, 0.05), RequestPhase("prefill", 0.05, 0.4), RequestPhase("decode", 0.4, 4.39))


def test_a_traceparent_makes_the_span_a_child_of_the_callers(bus, in_memory):
    _, spans = in_memory
    bus.publish(completion(trace_headers=(("traceparent", TRACEPARENT), ("tracestate", TRACESTATE))))
    (span,) = spans.get_finished_spans()
    assert span.parent is not None and span.parent.is_remote
    assert (span.context.trace_id, span.parent.span_id) == (int(TRACE_ID, 16), int(PARENT_ID, 16))
    assert span.context.span_id != int(PARENT_ID, 16)
    assert span.context.trace_state.to_header() == TRACESTATE  # the caller's vendors' state goes on
    assert span.context.trace_flags.sampled


@pytest.mark.parametrize("traceparent", [
    "00-4bf92f3577b34da6a3ce929d0e0e4736", "hello", "",
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
    f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # upper-case hex
    f"00-{TRACE_ID}-{PARENT_ID}-01" + "x" * 10_000,
])
def test_a_malformed_traceparent_starts_a_new_root_trace(bus, in_memory, traceparent):
    _, spans = in_memory
    bus.publish(completion(trace_headers=(("traceparent", traceparent), ("tracestate", TRACESTATE))))
    (span,) = spans.get_finished_spans()  # recorded; the bus fixture checks nothing raised
    assert span.parent is None and span.context.trace_id != int(TRACE_ID, 16)
    assert span.context.trace_state.to_header() == ""  # tracestate is never read without a valid parent


def test_no_trace_headers_start_a_root_span_even_inside_another_span(bus, in_memory):
    _, spans = in_memory
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("whatever publishes"):  # the bus runs subscribers in the publisher's context
        bus.publish(completion())
    (span,) = spans.get_finished_spans()
    assert span.parent is None


@pytest.mark.parametrize("endpoint, operation", [("chat.completions", "chat"), ("completions", "text_completion")])
def test_the_operation_follows_the_endpoint(bus, in_memory, endpoint, operation):
    reader, spans = in_memory
    bus.publish(completion(endpoint=endpoint))
    (span,) = spans.get_finished_spans()
    assert span.name == f"{operation} smollm2" and span.attributes["gen_ai.operation.name"] == operation
    for name, pts in points(reader).items():
        assert {p.attributes["gen_ai.operation.name"] for p in pts} == {operation}, name


def test_response_attributes_and_phase_events(bus, in_memory):
    _, spans = in_memory
    bus.publish(completion(response_id="chatcmpl-abc", finish_reasons=("stop", "length"), phases=PHASES))
    (span,) = spans.get_finished_spans()
    a = span.attributes
    assert a["gen_ai.response.id"] == "chatcmpl-abc" and a["gen_ai.response.model"] == "smollm2"
    assert a["gen_ai.response.finish_reasons"] == ("stop", "length")
    assert [e.name for e in span.events] == ["kvmeter.queue", "kvmeter.prefill", "kvmeter.decode"]
    start = span.start_time
    assert [e.timestamp - start for e in span.events] == [0, int(0.05e9), int(0.4e9)]
    assert [e.attributes["kvmeter.duration_s"] for e in span.events] == pytest.approx([0.05, 0.35, 3.99])
    bus.publish(completion(outcome="error", out=0, ttft=None, phases=PHASES[:1], finish_reasons=("error",)))
    failed = spans.get_finished_spans()[1]
    assert "gen_ai.response.id" not in failed.attributes  # unknown: not invented
    assert [e.name for e in failed.events] == ["kvmeter.queue"]


def test_the_semantic_convention_names_are_the_packaged_ones():
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai

    from kvmeter.exporters import otel

    assert (otel._RESPONSE_ID, otel._RESPONSE_MODEL, otel._FINISH_REASONS, otel._OPERATION) == (
        genai.GEN_AI_RESPONSE_ID, genai.GEN_AI_RESPONSE_MODEL, genai.GEN_AI_RESPONSE_FINISH_REASONS,
        genai.GEN_AI_OPERATION_NAME)
    assert set(otel.GENAI_OPERATIONS.values()) == {genai.GenAiOperationNameValues.CHAT.value,
                                                   genai.GenAiOperationNameValues.TEXT_COMPLETION.value}


def test_env_switches(bus, monkeypatch):
    assert install_otel(bus, env={"OTEL_SDK_DISABLED": "true"}) is None
    assert install_otel(bus, env={"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"}) is None
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        install_otel(bus, env={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        install_otel(bus, env={"OTEL_TRACES_EXPORTER": "zipkin"})


class Receiver:
    """A minimal OTLP/HTTP collector: decodes what the SDK's exporters send."""

    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self.content_types: set[str] = set()

    async def _body(self, request) -> bytes:
        body = await request.body()
        self.content_types.add(request.headers.get("content-type", ""))
        return gzip.decompress(body) if request.headers.get("content-encoding") == "gzip" else body

    async def on_metrics(self, request):
        self.metrics.append(ExportMetricsServiceRequest.FromString(await self._body(request)))
        return Response(ExportMetricsServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    async def on_traces(self, request):
        self.traces.append(ExportTraceServiceRequest.FromString(await self._body(request)))
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")


@pytest.fixture
def otlp_receiver(port):
    receiver = Receiver()
    app = Starlette(routes=[Route("/v1/metrics", receiver.on_metrics, methods=["POST"]),
                            Route("/v1/traces", receiver.on_traces, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # wait for the loopback server to listen (external start-up)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", receiver
    server.should_exit = True
    thread.join(timeout=10)


def _value(any_value):
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, which)


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def test_otlp_http_to_a_real_receiver(bus, otlp_receiver, monkeypatch):
    endpoint, receiver = otlp_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvmeter-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # export on flush only
    exporter = install_otel(bus)
    bus.publish(completion(tenant="acme"))
    bus.publish(completion(tenant="globex", outcome="error", out=0, ttft=None))
    assert exporter.force_flush()
    exporter.close()

    assert receiver.content_types == {"application/x-protobuf"}
    resource = _attrs(receiver.metrics[0].resource_metrics[0].resource.attributes)
    assert resource["service.name"] == "kvmeter-test" and resource["deployment.environment"] == "ci"
    metrics = {m.name: m for req in receiver.metrics for rm in req.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics}
    assert set(metrics) >= {"gen_ai.client.token.usage", "gen_ai.server.time_to_first_token",
                            "gen_ai.server.time_per_output_token", "gen_ai.server.request.duration"}
    usage = metrics["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    by_type = {_attrs(p.attributes)["gen_ai.token.type"]: p for p in usage.histogram.data_points}
    assert by_type["input"].sum == 2400 and by_type["output"].sum == 101
    assert list(by_type["input"].explicit_bounds)[:3] == [1, 4, 16]  # the semconv advisory buckets
    for m in metrics.values():
        for p in m.histogram.data_points:
            assert not any("tenant" in k for k in _attrs(p.attributes))
    spans = [s for req in receiver.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    by_tenant = {_attrs(s.attributes)["kvmeter.tenant.id"]: s for s in spans}
    assert set(by_tenant) == {"acme", "globex"}
    acme = _attrs(by_tenant["acme"].attributes)
    assert acme["gen_ai.usage.input_tokens"] == 1200 and acme["gen_ai.usage.output_tokens"] == 101
    assert by_tenant["globex"].status.code == 2  # STATUS_CODE_ERROR


# -- end to end: the real OpenAI SDK → kvmeter's gateway (instant engine) → a real OTLP receiver -----


@pytest.fixture
async def traced_gateway(model_dir, otlp_receiver, free_port, monkeypatch, request):
    """The gateway with vLLM's serving layer over the instant engine on loopback, its OTLP
    exporter (built from the ``OTEL_*`` environment, as ``serve`` builds it) sending to the receiver.
    Parametrized indirectly with a text, the instant engine answers that text (token by token)."""
    from prometheus_client import CollectorRegistry

    from kvmeter.model import DEFAULT_MODEL_NAME
    from kvmeter.serving.config import load_serve_config
    from kvmeter.serving.engines.hf_tokenizer import HFTokenizer
    from kvmeter.serving.engines.instant import InstantEngine
    from kvmeter.serving.gateway.app import create_app
    from kvmeter.serving.runtime import ServeRuntime
    from tests.conftest import start_uvicorn
    from tests.serving.gateway.conftest import MemoryRecorder

    endpoint, receiver = otlp_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # export on flush only
    port = free_port()
    config = load_serve_config(None, {("engine", "kind"): "instant", ("server", "port"): port}, env={})
    text = getattr(request, "param", None)
    engine = InstantEngine(HFTokenizer(model_dir), DEFAULT_MODEL_NAME, max_model_len=4096,
                           reply=None if text is None else (lambda _request: text))
    await engine.start()
    runtime = ServeRuntime(config, registry=CollectorRegistry(), engine=engine)
    runtime.gateway.recorder = MemoryRecorder()
    otel = install_otel(runtime.bus)
    app = create_app(runtime.gateway, on_startup=[runtime.scheduler.start], on_shutdown=[runtime.scheduler.stop])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = await start_uvicorn(server)
    yield f"http://127.0.0.1:{port}", otel, receiver
    server.should_exit = True
    await task
    otel.close()
    runtime.exporter.close()
    await engine.shutdown()


def _spans(receiver) -> list:
    return [s for req in receiver.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


async def test_the_openai_sdk_traceparent_joins_the_callers_trace(traced_gateway):
    import openai

    from tests.serving.gateway.conftest import KEYS

    base_url, otel, receiver = traced_gateway
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEYS["acme"])
    caller = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    chat = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        extra_headers=caller)
    text = await client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4,
                                           extra_headers={"traceparent": f"00-{TRACE_ID}-{'1' * 16}-01"})
    chunks = [c async for c in await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_headers=caller)]
    malformed = await client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2,
                                                extra_headers={"traceparent": "00-not-a-trace-01"})
    unsampled = await client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2,
                                                extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    await client.close()
    assert otel.force_flush()

    spans = {_attrs(s.attributes).get("gen_ai.response.id"): s for s in _spans(receiver)}
    assert unsampled.id not in spans  # the caller did not sample its trace: neither does kvmeter
    streamed_id = chunks[0].id
    assert set(spans) == {chat.id, text.id, streamed_id, malformed.id}
    for reply_id, parent, operation in ((chat.id, PARENT_ID, "chat"), (text.id, "1" * 16, "text_completion"),
                                        (streamed_id, PARENT_ID, "chat")):
        span = spans[reply_id]
        assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, parent), reply_id
        assert span.kind == 2  # SPAN_KIND_SERVER
        a = _attrs(span.attributes)
        assert a["gen_ai.operation.name"] == operation and span.name == f"{operation} SmolLM2-135M-Instruct"
        assert a["gen_ai.response.model"] == "SmolLM2-135M-Instruct"
        events = list(span.events)
        assert [e.name for e in events] == ["kvmeter.queue", "kvmeter.prefill", "kvmeter.decode"], reply_id
        times = [e.time_unix_nano for e in events]
        assert span.start_time_unix_nano <= times[0] <= times[1] <= times[2] <= span.end_time_unix_nano
        durations = [_attrs(e.attributes)["kvmeter.duration_s"] for e in events]
        assert all(d >= 0 for d in durations)
        assert times[1] - times[0] == pytest.approx(durations[0] * 1e9, abs=1e3)  # prefill starts as the queue ends
    assert spans[chat.id].trace_state == TRACESTATE and spans[streamed_id].trace_state == TRACESTATE
    chat_attrs = _attrs(spans[chat.id].attributes)
    assert chat_attrs["gen_ai.response.finish_reasons"] == [c.finish_reason for c in chat.choices] == ["length"] * 2
    assert chat_attrs["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens == 10
    assert chat_attrs["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert _attrs(spans[text.id].attributes)["gen_ai.response.finish_reasons"] == [text.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        _attrs(spans[streamed_id].attributes)["gen_ai.response.finish_reasons"]
    # a malformed traceparent: answered 200, its span the root of a new trace
    root = spans[malformed.id]
    assert root.parent_span_id == b"" and root.trace_id.hex() != TRACE_ID and len(root.trace_id) == 16


#: a hermes tool call (vLLM's default ``--tool-call-parser`` for kvmeter's serving layer)
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("traced_gateway", [TOOL_CALL], indirect=True, ids=["hermes"])
async def test_the_spans_finish_reasons_are_tool_calls_where_the_answer_ends_in_tool_calls(traced_gateway):
    """The engine stops with ``stop``; vLLM's layer parses the tool call and answers ``tool_calls``
    (after the engine's last output, so after the usage event): the span carries the answer's
    reason for each of the ``n`` choices, in a JSON answer and in a stream."""
    import openai

    from tests.serving.gateway.conftest import KEYS

    base_url, otel, receiver = traced_gateway
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEYS["acme"], max_retries=0)
    ask = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "weather in Paris?"}],
           "max_tokens": 64, "n": 2, "tools": WEATHER}
    whole = await client.chat.completions.create(**ask)
    chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    await client.close()
    assert otel.force_flush()

    assert [c.finish_reason for c in whole.choices] == ["tool_calls"] * 2
    assert whole.choices[0].message.tool_calls[0].function.name == "get_weather"
    streamed = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert streamed == {0: "tool_calls", 1: "tool_calls"}
    spans = {_attrs(s.attributes).get("gen_ai.response.id"): s for s in _spans(receiver)}
    assert _attrs(spans[whole.id].attributes)["gen_ai.response.finish_reasons"] == ["tool_calls"] * 2
    assert _attrs(spans[chunks[0].id].attributes)["gen_ai.response.finish_reasons"] == ["tool_calls"] * 2
