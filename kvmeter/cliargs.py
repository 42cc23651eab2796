"""argparse value types shared by kvmeter's subcommands (one place, one wording of the errors)."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["int_at_least", "positive_int", "non_negative_int", "http_url"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting an integer ≥ ``minimum``.

    Raises (from the returned callable):
        argparse.ArgumentTypeError: not an integer, or below ``minimum`` (argparse turns it into a
            one-line usage error, exit status 2).
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


#: an integer ≥ 1
positive_int = int_at_least(1)
#: an integer ≥ 0
non_negative_int = int_at_least(0)


def http_url(text: str) -> str:
    """argparse type: an http(s):// base URL, returned without a trailing slash."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")
