"""``kvmeter replay``'s argument and connection errors: one line, naming the flag or the URL."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from kvmeter.cli import build_parser
from kvmeter.serving.replay import cli
from kvmeter.serving.replay.client import replay
from kvmeter.serving.replay.plan import ReplayRequest, ReplayTenant


def _parse(*argv: str):
    return build_parser(["replay"]).parse_args(["replay", *argv])


def _closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv,flag", [
    (["--requests", "-5"], "--requests"),      # once blamed the trace file ("can't convert negative int")
    (["--requests", "0"], "--requests"),
    (["--noisy-input-tokens", "0"], "--noisy-input-tokens"),
    (["--noisy-prompt-tokens", "0"], "--noisy-input-tokens"),  # the old spelling is the same option
    (["--server", "127.0.0.1:8000"], "--server"),
])
def test_bad_arguments_are_argparse_errors(argv: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(*(["--server", "http://127.0.0.1:8000"] if "--server" not in argv else []), *argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: argument {flag}" in err and "AzureLLMInferenceTrace" not in err


def test_the_old_noisy_flag_spelling_still_sets_the_input_tokens() -> None:
    args = _parse("--server", "http://127.0.0.1:8000", "--noisy-prompt-tokens", "100")
    assert args.noisy_input_tokens == 100


def test_a_refused_connection_names_the_url(capsys, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    args = _parse("--server", url, "--requests", "3", "--model-dir", str(tmp_path))  # no --tenant: demo tenants
    assert cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach ") and f"{url}/v1/models" in err and "\n" not in err, err


def test_a_refused_key_names_the_url_and_the_way_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "unknown API key", "code": "invalid_api_key"}})

    with pytest.raises(ValueError, match=r"GET http://gw:8000/v1/models answered 401: unknown API key.*--model"):
        cli.served_model("http://gw:8000", "sk-x", transport=httpx.MockTransport(handler))
    ok = httpx.MockTransport(lambda r: httpx.Response(200, json={"data": [{"id": "smollm2"}]}))
    assert cli.served_model("http://gw:8000", "sk-x", transport=ok) == "smollm2"


def test_a_failed_request_records_the_url_it_tried() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    plan = [ReplayRequest(0, ReplayTenant("a", "k-a"), 0.0, 10, 2, 10, 2)]
    (result,) = asyncio.run(replay(url, "m", plan, lambda r: [{"role": "user", "content": "hi"}],
                                   print_fn=lambda line: None))
    assert result.status == 0 and f"{url}/v1/chat/completions" in result.error and "ConnectError" in result.error


def test_an_out_path_in_a_missing_directory_is_refused_before_replaying(capsys, tmp_path: Path) -> None:
    args = _parse("--server", "http://127.0.0.1:1", "--out", str(tmp_path / "no" / "results.csv"))
    assert cli.run(args) == 2
    assert "--out" in capsys.readouterr().err
