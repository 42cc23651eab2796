"""``kvmeter serve`` as a user runs it (a subprocess, the instant engine): a bad ledger DSN is one
``cannot start`` line with status 2, and Ctrl+C stops it gracefully with status 0, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvmeter.serving.demo import wait_ready
from tests.conftest import free_port, ledger_held_by_another_process


def _serve(tmp_path: Path, port: int, *flags: str) -> subprocess.Popen:
    """``kvmeter serve --engine instant`` on ``port``, its output in ``tmp_path/serve.log``."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp_path / "serve.log", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "kvmeter.cli", "serve", "--engine", "instant",
                                 "--port", str(port), "--spool-dir", str(tmp_path / "spool"), *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def test_bad_ledger_dsn_is_one_cannot_start_line(tmp_path):
    log = tmp_path / "serve.log"
    proc = _serve(tmp_path, free_port(), "--ledger-dsn", "bogus://x")
    assert proc.wait(120) == 2, log.read_text()
    text = log.read_text()
    assert "cannot start: ledger DSN scheme must be chdb, http or https, got 'bogus'" in text, text
    assert "Traceback" not in text and "Application startup failed" not in text, text
    assert "Started server process" not in text, "uvicorn should never have started"


@pytest.mark.parametrize("flags, why", [
    (("--vllm-arg=--no-such-flag",), "vLLM does not know the arguments ['--no-such-flag']"),
    (("--vllm-arg=--max-logprobs", "--vllm-arg=many"), "argument --max-logprobs: invalid int value: 'many'"),
])
def test_a_vllm_argument_vllm_refuses_is_one_cannot_start_line(tmp_path, flags, why):
    proc = _serve(tmp_path, free_port(), "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}", *flags)
    assert proc.wait(180) == 2
    text = (tmp_path / "serve.log").read_text()
    assert "cannot start: " in text and why in text, text
    assert "Traceback" not in text and "Started server process" not in text, text


def test_a_taken_port_is_one_cannot_start_line_before_anything_loads(tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(tmp_path, port, "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}")
        assert proc.wait(120) == 2
    text = (tmp_path / "serve.log").read_text()
    assert f"cannot start: cannot listen on 127.0.0.1:{port}" in text, text
    assert "Traceback" not in text and "Started server process" not in text, text
    assert not (tmp_path / "chdb").exists(), "the ledger was opened before the port was checked"


def test_a_spool_held_by_another_process_is_one_cannot_start_line(tmp_path):
    from kvmeter.clock import SYSTEM_CLOCK
    from kvmeter.ledger.records import STREAMS
    from kvmeter.ledger.spool import Spool
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from kvmeter.clock import SYSTEM_CLOCK; "
        "from kvmeter.ledger.records import STREAMS; from kvmeter.ledger.spool import Spool; "
        f"s = Spool(Path({str(tmp_path / 'spool')!r}), STREAMS, clock=SYSTEM_CLOCK); print('held', flush=True); "
        "sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert Spool.held_elsewhere(tmp_path / "spool")
        proc = _serve(tmp_path, free_port(), "--ledger-dsn", f"chdb://{tmp_path / 'chdb'}")
        assert proc.wait(120) == 2
        text = (tmp_path / "serve.log").read_text()
        assert f"cannot start: the ledger spool {tmp_path / 'spool'} is held by another process" in text, text
        assert "Traceback" not in text and "Started server process" not in text, text
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert not Spool.held_elsewhere(tmp_path / "spool")  # released with its holder
    Spool(tmp_path / "spool", STREAMS, clock=SYSTEM_CLOCK).close()  # and free to open


def test_an_embedded_ledger_held_by_another_process_is_one_cannot_start_line(tmp_path):
    from kvmeter.ledger import LedgerConfig
    from kvmeter.ledger.connection import embedded_held_elsewhere
    chdb = tmp_path / "chdb"
    config = LedgerConfig(dsn=f"chdb://{chdb}", spool_dir=tmp_path / "spool")
    with ledger_held_by_another_process(chdb, tmp_path / "held-spool"):
        assert embedded_held_elsewhere(config)
        proc = _serve(tmp_path, free_port(), "--ledger-dsn", f"chdb://{chdb}")  # its own spool: free
        assert proc.wait(120) == 2
        text = (tmp_path / "serve.log").read_text()
        assert f"cannot start: the embedded ledger at {chdb} is held by another process" in text, text
        assert "Traceback" not in text and "Cannot lock file" not in text, text
        assert "Started server process" not in text, text
    assert not embedded_held_elsewhere(config)  # released with its holder
    assert not embedded_held_elsewhere(LedgerConfig(dsn="http://127.0.0.1:1/kvmeter", spool_dir=tmp_path))


@pytest.mark.slow
def test_ctrl_c_stops_gracefully_without_a_traceback(tmp_path):
    log = tmp_path / "serve.log"
    port = free_port()
    proc = _serve(tmp_path, port, "--ledger-dsn", f"chdb://{tmp_path}/chdb")
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log, timeout_s=180)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "CancelledError" not in text, text
    assert "Application shutdown complete" in text and "kvmeter serve: stopped (SIGINT)" in text, text


@pytest.mark.slow
def test_server_body_read_timeout_from_the_config_file_answers_a_stalled_body_408(tmp_path):
    import socket

    (tmp_path / "serve.yaml").write_text("server:\n  body_read_timeout_s: 0.3\n")
    log = tmp_path / "serve.log"
    port = free_port()
    proc = _serve(tmp_path, port, "--config", str(tmp_path / "serve.yaml"),
                  "--ledger-dsn", f"chdb://{tmp_path}/chdb")
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log, timeout_s=180)
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer sk-demo-acme-0001\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 62\r\n\r\n{\"model\": ")
            raw = b""
            while chunk := sock.recv(65536):  # until the server closes (Connection: close)
                raw += chunk
        assert raw.startswith(b"HTTP/1.1 408"), raw[:300]
        assert b'"code":"request_timeout"' in raw and b"0.3 s" in raw, raw
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "request body not received within 0.3 s" in text, text
    assert "Traceback" not in text, text
