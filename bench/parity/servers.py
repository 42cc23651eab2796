"""Start and stop the servers the parity harness compares: vLLM's own OpenAI server and
``kvmeter serve`` — on the same model with the same engine settings (``--engine vllm``), or as
``--engine remote`` in front of that vLLM server.

Both run as subprocesses in their own process group (``start_new_session``): vLLM's EngineCore
child does not watch its parent, so :meth:`Server.stop` signals the whole group (SIGINT, then
SIGKILL after a grace period), as ``tests/e2e/test_kill9.py`` does.

Engine settings both get (:class:`EngineSettings`): the model directory, ``max_model_len``,
``max_num_seqs``, the engine seed (0, kvmeter's fixed engine seed), the KV cache size
(``VLLM_CPU_KVCACHE_SPACE``, GiB), prefix caching on, priority scheduling (kvmeter's vLLM engine
always runs with it). vLLM's server also gets the flags an agent platform runs it with
(``--enable-auto-tool-choice --tool-call-parser hermes``) and ``--enable-request-id-headers``
(echo ``X-Request-Id`` on every response, as kvmeter does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from kvmeter.net import free_port

__all__ = ["EngineSettings", "Server", "free_port", "start_vllm", "start_kvmeter", "PARITY_KEY",
           "tenants_yaml", "vllm_command", "wait_all_ready"]

ROOT = Path(__file__).resolve().parents[2]
#: the API key of the harness's tenant on kvmeter (vLLM's server, started without --api-key,
#: ignores the header); the same header goes to both servers
PARITY_KEY = "sk-parity-0001"


def tenants_yaml() -> str:
    """One tenant with no quota limits and a 600 s TTFT objective, so kvmeter refuses nothing for
    quota or overload reasons and both servers do the same work."""
    return (
        "version: 1\n"
        "default_tier: parity\n"
        "tiers:\n"
        "  parity: {weight: 1.0, ttft_slo_s: 600.0, limits: {}}\n"
        "orgs:\n"
        "  parity:\n"
        "    tier: parity\n"
        "    workspaces:\n"
        "      default:\n"
        "        projects:\n"
        "          default:\n"
        "            api_keys:\n"
        f"              parity-key: {{key: {PARITY_KEY}}}\n"
    )


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings both servers run with.

    Attributes:
        model_dir: the model directory (SmolLM2-135M-Instruct, dequantized).
        served_name: the model name clients send.
        max_model_len: context window (tokens).
        max_num_seqs: running-batch cap.
        kv_cache_gib: CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB).
        seed: engine seed (kvmeter's engine always uses 0).
    """

    model_dir: Path
    served_name: str
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_gib: int = 1
    seed: int = 0


class Server:
    """A started server: its base URL, process and log. ``stop()`` ends the whole process group."""

    def __init__(self, kind: str, url: str, proc: subprocess.Popen, log_path: Path) -> None:
        self.kind = kind
        self.url = url
        self.proc = proc
        self.log_path = log_path
        self.started = time.monotonic()
        self.startup_s: float | None = None

    def poll_ready(self) -> bool:
        """One check: does ``GET /v1/models`` answer 200? Records the start-up time (seconds
        since the process started) the first time it does.

        Raises:
            RuntimeError: the process has exited (with the log's last 25 lines).
        """
        if self.startup_s is not None:
            return True
        if self.proc.poll() is not None:
            tail = "\n  ".join(self.log_path.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}:\n  {tail}")
        try:
            r = httpx.get(f"{self.url}/v1/models", headers={"authorization": f"Bearer {PARITY_KEY}"}, timeout=2)
        except httpx.HTTPError:
            return False
        if r.status_code == 200:
            self.startup_s = time.monotonic() - self.started
        return self.startup_s is not None

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Wait until this server is ready; returns its start-up time (seconds)."""
        wait_all_ready([self], timeout_s)
        return self.startup_s  # type: ignore[return-value]

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGINT to the process group, SIGKILL to it after ``grace_s`` (the group: vLLM's
        EngineCore outlives a parent killed alone). Safe to call twice."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (EngineCore children), parent gone or not
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_all_ready(servers: list[Server], timeout_s: float = 900.0) -> dict[str, float]:
    """Poll every server once a second until all are ready (each one's start-up time is its own,
    though they load at the same time); prints a line every 15 s. Returns kind → start-up seconds.

    Raises:
        RuntimeError: one exited (its log's tail), or not all were ready after ``timeout_s``.
    """
    t0 = last = time.monotonic()
    while True:
        pending = [s for s in servers if not s.poll_ready()]
        if not pending:
            return {s.kind: s.startup_s for s in servers}  # type: ignore[misc]
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError("not ready after {:.0f}s: {}".format(
                timeout_s, ", ".join(f"{s.kind} (log: {s.log_path})" for s in pending)))
        if time.monotonic() - last > 15:
            last = time.monotonic()
            print(f"  loading {', '.join(s.kind for s in pending)} ... {last - t0:.0f}s", flush=True)
        time.sleep(1)


def _env(settings: EngineSettings) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib), "TOKENIZERS_PARALLELISM": "false"}


def vllm_command(settings: EngineSettings, port: int) -> list[str]:
    """vLLM's OpenAI server. (``vllm serve`` looks up the distribution "vllm", which vllm-cpu
    does not provide; the module it runs is the same server.)"""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(settings.model_dir),
            "--served-model-name", settings.served_name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
            "--seed", str(settings.seed), "--enable-prefix-caching", "--scheduling-policy", "priority",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-request-id-headers",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]


def start_vllm(settings: EngineSettings, workdir: Path, port: int | None = None) -> Server:
    """Start vLLM's OpenAI server (not yet ready: call ``wait_ready`` or :func:`wait_all_ready`)."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"vllm-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(vllm_command(settings, port), stdout=log, stderr=subprocess.STDOUT,
                                env=_env(settings), cwd=ROOT, start_new_session=True)
    return Server("vllm", f"http://127.0.0.1:{port}", proc, log_path)


def start_kvmeter(settings: EngineSettings, workdir: Path, port: int | None = None,
                  remote_url: str | None = None) -> Server:
    """Start ``kvmeter serve`` with one unlimited tenant (key :data:`PARITY_KEY`), its own
    embedded ledger and spool under ``workdir``: on the vLLM engine, or — with ``remote_url``, a
    running vLLM OpenAI server — as ``--engine remote`` in front of that server (the transparent
    proxy; the model directory gives it the tokenizer for its estimates)."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    tenants = workdir / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    kind = "kvmeter-remote" if remote_url else "kvmeter"
    log_path = workdir / f"{kind}-{port}.log"
    if remote_url:
        engine = ["--engine", "remote", "--remote-url", remote_url, "--model", str(settings.model_dir)]
    else:
        engine = ["--engine", "vllm", "--model", str(settings.model_dir),
                  "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
                  "--kv-cache-gib", str(settings.kv_cache_gib)]
    cmd = [sys.executable, "-m", "kvmeter.cli", "serve", *engine, "--port", str(port),
           "--tenants", str(tenants), "--ledger-dsn", f"chdb://{workdir / 'chdb'}",
           "--spool-dir", str(workdir / "spool")]
    env = _env(settings)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                start_new_session=True)
    return Server(kind, f"http://127.0.0.1:{port}", proc, log_path)
