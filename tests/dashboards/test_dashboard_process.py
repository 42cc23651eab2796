"""``kvmeter dashboard`` as a real process: a signal sent to its pid stops Streamlit and frees the port.

The console script ``kvmeter`` of this venv runs ``kvmeter dashboard`` in server mode (no ledger
is opened: Streamlit answers its health endpoint before any page reads). The test sends the
signal to the pid it started — what ``kill PID`` or ``docker stop`` does — never to the process
group, so a Streamlit child that did not get the signal would survive and fail the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

START_TIMEOUT_S = 180.0  # Streamlit's start on 2 busy cores
STOP_TIMEOUT_S = 30.0


def _streamlit_pids(port: int) -> list[int]:
    """Pids of live ``streamlit run`` processes listening (by their command line) on ``port``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = next((line for line in (entry / "status").read_text().splitlines()
                          if line.startswith("State:")), "")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if "zombie" in state:  # exited, only not reaped yet: it holds no port
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "streamlit" in args and "--server.port" in args and \
                args[args.index("--server.port") + 1:args.index("--server.port") + 2] == [str(port)]:
            found.append(int(entry.name))
    return found


def _port_is_free(port: int) -> bool:
    """True when a new server could listen on ``port`` (as Streamlit itself would: SO_REUSEADDR,
    so connections left in TIME_WAIT do not count; a listening socket does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_until_serving(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"kvmeter dashboard exited with {proc.returncode}:\n{log.read_text()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"no HTTP answer on port {port} within {START_TIMEOUT_S} s:\n" \
                                            f"{log.read_text()}"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_dashboard_pid_stops_streamlit_and_frees_the_port(sig: signal.Signals, tmp_path: Path):
    script = Path(sys.executable).with_name("kvmeter")
    assert script.is_file(), f"console script {script} missing (pip install -e .)"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETER_DASHBOARD_")}
    log = tmp_path / "dashboard.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(script), "dashboard", "--server", "http://127.0.0.1:9", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)  # its own group: a terminal's Ctrl-C here never reaches it
    try:
        _wait_until_serving(proc, port, log)
        assert _streamlit_pids(port), "the serving process is not a streamlit run on this port"
        os.kill(proc.pid, sig)  # the pid only, as kill / docker stop do
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvmeter dashboard did not exit within {STOP_TIMEOUT_S} s of {sig.name}:\n{log.read_text()}")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (_streamlit_pids(port) or not _port_is_free(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = _streamlit_pids(port)
        assert not survivors, f"streamlit pid(s) {survivors} outlived {sig.name} to kvmeter dashboard ({proc.pid})"
        assert _port_is_free(port), f"port {port} still held {STOP_TIMEOUT_S} s after {sig.name}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait(30)
        for pid in _streamlit_pids(port):  # orphans of this run (matched by its unique port)
            os.kill(pid, signal.SIGKILL)
