"""``kvmeter check --server URL``: the self-checks of a running ``kvmeter serve``, one line each.

Reads ``URL/metrics`` (see :mod:`.checks` for what each line judges). Exit status: 0 when every
check passes (or is skipped), 1 when one fails, 2 when the page cannot be read.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from kvmeter.clock import SYSTEM_CLOCK

from .checks import parse_exposition, run_checks

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, metavar="URL",
                        help="the running kvmeter serve (its /metrics page is read), e.g. http://127.0.0.1:8000")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S", help="HTTP timeout, seconds (default 10)")


def run(args: argparse.Namespace) -> int:
    url = args.server.rstrip("/") + "/metrics"
    try:
        resp = httpx.get(url, timeout=args.timeout)
        resp.raise_for_status()
        samples = parse_exposition(resp.text)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"kvmeter check: cannot read {url}: {exc}", file=sys.stderr)
        return 2
    results = run_checks(samples, SYSTEM_CLOCK.wall())
    for result in results:
        print(result.line())
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"{len(failed)} of {len(results)} checks failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
