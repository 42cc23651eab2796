"""``kvmeter serve`` — the OpenAI-compatible gateway in front of an engine, under uvicorn.

Examples::

    kvmeter serve                                   # SmolLM2-135M on vLLM (CPU), embedded ledger
    kvmeter serve --config deploy/kvmeter/kvmeter.yaml
    kvmeter serve --engine remote --remote-url http://gpu-node:8000 --model /models/llama
    kvmeter serve --engine remote --replica http://gpu-a:8000 --replica http://gpu-b:8000 --model /models/llama
    kvmeter serve --model /models/qwen2.5-7b --tool-call-parser hermes --vllm-arg=--max-logprobs=50
    kvmeter serve --workers 4 --engine remote --remote-url http://gpu-node:8000 \
        --quota-store redis://redis:6379/0 --ledger-dsn http://kvmeter:pw@clickhouse:8123/kvmeter

Flags override the config file, which overrides environment variables (see
:mod:`kvmeter.serving.config`).

Exit status: 0 after a graceful stop (Ctrl+C / SIGINT included; SIGTERM stops as gracefully, then
uvicorn re-raises it: -15); 2 for an invalid setting, ledger DSN included, a port already in use
or a ledger spool or embedded ledger path held by another process (one line, ``cannot start:
...``, before the engine loads); 3 when the app fails while starting (uvicorn's lifespan: the engine or
ledger could not open; with ``--workers N``, a worker that failed to start); 130 for Ctrl+C before
the server started.

``--workers N`` (``server.workers``) runs N gateway processes on one port under uvicorn's
supervisor; what they share and what refuses it: :mod:`kvmeter.serving.workers`.
"""

from __future__ import annotations

import argparse
import logging
import socket

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="serve config YAML (default $KVMETER_CONFIG)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument("--workers", type=int,
                        help="gateway processes on the one port (default 1; above 1: --engine remote or "
                             "instant, a redis:// quota store, an http(s):// ledger)")
    parser.add_argument("--engine", choices=["vllm", "remote", "instant"], help="engine kind")
    parser.add_argument("--model", help="smollm2 (default), a model directory or a .gguf file")
    parser.add_argument("--max-model-len", type=int, help="context window in tokens")
    parser.add_argument("--kv-cache-gib", type=int, help="KV cache size on the CPU engine (whole GiB)")
    parser.add_argument("--max-num-seqs", type=int, help="engine running-batch cap")
    parser.add_argument("--remote-url", help="upstream OpenAI-compatible server (engine=remote)")
    parser.add_argument("--remote-metrics-url",
                        help="the upstream's vLLM /metrics, scraped for KV gating "
                             "(default <remote-url>/metrics; off: none)")
    parser.add_argument("--replica", action="append", metavar="URL",
                        help="a replica of an engine pool (engine=remote; repeat for each; instead of --remote-url)")
    parser.add_argument("--routing", choices=["prefix_aware", "least_kv", "round_robin"],
                        help="how an engine pool picks a replica (default prefix_aware)")
    parser.add_argument("--tenants", help="principals/quota YAML (default: the demo tenants)")
    parser.add_argument("--quota-store", help="memory://, redis://host:port/db or rediss://... (TLS)")
    parser.add_argument("--scheduler", choices=["vtc", "fcfs"], help="scheduling policy")
    parser.add_argument("--ledger-dsn", help="chdb:///path or http(s)://user:pw@host:port/db")
    parser.add_argument("--spool-dir", help="the ledger's durable spool directory")
    parser.add_argument("--prices", help="price list YAML (default: the packaged one)")
    parser.add_argument("--tool-call-parser",
                        help="vLLM's tool-call parser for the served model (default hermes; none: off)")
    parser.add_argument("--reasoning-parser", help="vLLM's reasoning parser (deepseek_r1, qwen3, ...)")
    parser.add_argument("--chat-template", help="a chat template file (or inline Jinja) instead of the model's")
    parser.add_argument("--vllm-arg", action="append", metavar="ARG",
                        help="one more `vllm serve` argument, passed through (repeatable; "
                             "--vllm-arg=--max-logprobs --vllm-arg=50)")


def _preflight(host: str, port: int, ledger) -> str | None:  # noqa: ANN001 — a LedgerConfig
    """What would make the server fail after loading the engine (minutes, on vLLM), checked
    first: the port is taken, or another process holds the ledger's spool or its embedded chDB
    path. ``None`` if none of these."""
    from kvmeter.ledger.connection import embedded_held_elsewhere
    from kvmeter.ledger.spool import Spool

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve --host {host!r}: {exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server on that port?)"
    if Spool.held_elsewhere(ledger.spool_dir):
        return (f"the ledger spool {ledger.spool_dir} is held by another process (another `kvmeter serve`?); "
                "stop it, or give this server its own --spool-dir and --ledger-dsn")
    if embedded_held_elsewhere(ledger):
        return (f"the embedded ledger at {ledger.parsed_dsn.path} is held by another process (another "
                "`kvmeter serve`?); stop it, or give this server its own --ledger-dsn")
    return None


def _run_workers(config) -> int:  # noqa: ANN001 — a ServeConfig
    """``--workers N`` above 1: refuse what cannot be shared, check what the single-process path's
    :class:`ServeRuntime` would check first (the ledger settings, tenants file, price list, port,
    spool), then supervise the workers.

    Raises:
        ServeConfigError, ValueError, OSError: an invalid setting (the caller's one line, status 2).
    """
    from kvmeter.ledger.prices import load_price_list
    from kvmeter.serving.runtime import ledger_config_of
    from kvmeter.serving.tenancy import TenantDirectory
    from kvmeter.serving.workers import run_workers, workers_problem

    ledger = ledger_config_of(config)
    problem = workers_problem(config, ledger)
    if problem is None:
        TenantDirectory.from_file(config.tenants_path())
        load_price_list(config.prices)
        problem = _preflight(config.server.host, config.server.port, ledger)
    if problem:
        log.error("cannot start: %s", problem)
        return 2
    log.info("kvmeter serve: %d workers, %s engine, on http://%s:%d", config.server.workers, config.engine.kind,
             config.server.host, config.server.port)
    return run_workers(config, ledger)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvmeter.model import ModelError
    from kvmeter.serving.config import ServeConfigError, load_serve_config
    from kvmeter.serving.engines.base import EngineError
    from kvmeter.serving.runtime import ServeRuntime

    overrides = {
        ("server", "host"): args.host, ("server", "port"): args.port, ("server", "workers"): args.workers,
        ("engine", "kind"): args.engine, ("engine", "model"): args.model,
        ("engine", "max_model_len"): args.max_model_len,
        ("engine", "kv_cache_space_gib"): args.kv_cache_gib,
        ("engine", "max_num_seqs"): args.max_num_seqs, ("engine", "remote_url"): args.remote_url,
        ("engine", "remote_metrics_url"): args.remote_metrics_url,
        ("engine", "replicas"): args.replica, ("engine", "routing"): args.routing,
        ("tenants",): args.tenants, ("quota_store",): args.quota_store,
        ("scheduler", "policy"): args.scheduler, ("ledger_dsn",): args.ledger_dsn,
        ("spool_dir",): args.spool_dir, ("prices",): args.prices,
        ("openai", "reasoning_parser"): args.reasoning_parser, ("openai", "chat_template"): args.chat_template,
        ("openai", "vllm_args"): args.vllm_arg,
    }
    if args.tool_call_parser is not None:  # "none" turns tool calling off, as no parser
        off = args.tool_call_parser.lower() in ("", "none", "off")
        overrides[("openai", "tool_call_parser")] = "" if off else args.tool_call_parser
        if off:
            overrides[("openai", "enable_auto_tool_choice")] = False
    try:
        config = load_serve_config(args.config, overrides)
        if config.server.workers > 1:
            return _run_workers(config)
        runtime = ServeRuntime(config)  # checks the ledger settings too (ConfigError: a ValueError)
    except (ServeConfigError, ModelError, EngineError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except KeyboardInterrupt:  # Ctrl+C while the model is prepared or loaded
        log.info("kvmeter serve: interrupted before start")
        return 130
    problem = _preflight(config.server.host, config.server.port, runtime.ledger_config())
    if problem:
        log.error("cannot start: %s", problem)
        return 2
    app = runtime.app()
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
        lifespan="on", timeout_graceful_shutdown=30, access_log=False))
    log.info("kvmeter serve: %s engine, model%s %s, on http://%s:%d", config.engine.kind,
             "s" if len(runtime.models) > 1 else "", ", ".join(runtime.models.names), config.server.host,
             config.server.port)
    from kvmeter.net import listening_socket

    sock = listening_socket(server.config, config.server.send_buffer_bytes)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # SIGINT: uvicorn has already shut down gracefully (connections drained, lifespan
        # shutdown run: spool drained, ledger and engine closed), then re-raised the signal, which
        # asyncio.run turns into KeyboardInterrupt. Nothing is left to do: a clean exit.
        log.info("kvmeter serve: stopped (SIGINT)")
    finally:
        sock.close()
    return 0 if server.started else 1
