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
from kvmeter.stats import RequestCompletion
from kvmeter.tokens import TokenCounts


def completion(tenant="acme", outcome="ok", prompt=1200, cached=512, out=101, ttft=0.4, e2e=4.4, **kw):
    return RequestCompletion(
        attribution=Attribution(tenant, tier="paid_interactive", model="smollm2"),
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


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out


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
