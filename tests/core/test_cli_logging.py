"""The CLI's logging defaults: library request lines (httpx) need -v or --log-level."""

from __future__ import annotations

import logging

import pytest

from kvmeter.cli import CHATTY_LIBRARIES, build_parser, configure_logging


@pytest.fixture(autouse=True)
def _restore_library_levels():
    names = (*CHATTY_LIBRARIES, "")
    saved = {name: logging.getLogger(name or None).level for name in names}
    yield
    for name, level in saved.items():
        logging.getLogger(name or None).setLevel(level)


@pytest.mark.parametrize("argv, httpx_info_shown", [
    (["replay", "--server", "http://127.0.0.1:1"], False),
    (["-v", "replay", "--server", "http://127.0.0.1:1"], True),
    (["replay", "--server", "http://127.0.0.1:1", "-v"], True),
    (["--log-level", "INFO", "replay", "--server", "http://127.0.0.1:1"], True),
    (["billing", "report", "--period", "2026-11"], False),
])
def test_httpx_request_lines_need_verbose(argv, httpx_info_shown):
    args = build_parser(argv).parse_args(argv)
    configure_logging(args)
    assert logging.getLogger("httpx").isEnabledFor(logging.INFO) is httpx_info_shown
    assert logging.getLogger("httpcore").isEnabledFor(logging.INFO) is httpx_info_shown
