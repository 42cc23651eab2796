"""``kvmeter check --server URL`` over real HTTP (issue 15 item 6): one line per check and an exit
status that says whether one failed — 1 when fewer TTFT samples than streams that ended ok were
recorded (a stream whose first token was never timed), 0 when they agree, 2 when the page cannot
be read."""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from kvmeter.serving.selfcheck.cli import run

PAGE = """# HELP kvmeter_request_ttft_seconds Time to first token.
# TYPE kvmeter_request_ttft_seconds histogram
kvmeter_request_ttft_seconds_bucket{{le="0.01"}} 0.0
kvmeter_request_ttft_seconds_bucket{{le="+Inf"}} {ttfts}
kvmeter_request_ttft_seconds_count {ttfts}
kvmeter_request_ttft_seconds_sum 0.9
# HELP kvmeter_selfcheck_streamed_ok_requests_total Streams that ended ok with output.
# TYPE kvmeter_selfcheck_streamed_ok_requests_total counter
kvmeter_selfcheck_streamed_ok_requests_total 2.0
"""


@pytest.fixture
def page() -> Iterator[tuple[str, dict]]:
    """A real HTTP server on loopback serving ``state["text"]`` at ``/metrics`` (404 elsewhere)."""
    state: dict = {"text": ""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name for a GET
            body = state["text"].encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_missing_ttft_sample_fails_the_check_and_the_exit_status(page, capsys):
    url, state = page
    state["text"] = PAGE.format(ttfts=1.0)
    assert run(argparse.Namespace(server=url, timeout=10.0)) == 1
    out = capsys.readouterr().out
    assert "FAIL  ttft_samples    1 TTFT samples for 2 streams that ended ok with output" in out
    assert out.rstrip().endswith("1 of 7 checks failed: ttft_samples")


def test_agreeing_numbers_pass_and_exit_0(page, capsys):
    url, state = page
    state["text"] = PAGE.format(ttfts=2.0)
    assert run(argparse.Namespace(server=url, timeout=10.0)) == 0
    assert capsys.readouterr().out.rstrip().endswith("0 of 7 checks failed")


def test_a_page_that_cannot_be_read_exits_2(page, capsys):
    url, state = page
    assert run(argparse.Namespace(server=url + "/nowhere", timeout=10.0)) == 2
    assert "cannot read" in capsys.readouterr().err
