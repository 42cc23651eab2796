"""The differences from vLLM's own OpenAI server that do not fail a parity case — each with its
reason. Keep it short: an entry is a promise that the difference is deliberate and harmless to an
OpenAI client. Patterns are :mod:`fnmatch` globs over the case name and the dotted field path
(see ``compare.py``: ``body.error.message``, ``headers.content-type``, ``status``).

The vLLM-against-vLLM check (``run.py --no-allowlist``) uses none of these.
"""

from __future__ import annotations

from bench.parity.compare import Allowed

__all__ = ["ALLOWLIST"]

ALLOWLIST: list[Allowed] = [
    Allowed("bad_*", "body.error.message",
            "wording only: kvmeter's messages name the field and never echo the input (its hostile-input "
            "rule), where vLLM prints pydantic's error list with the value; status, type, param and code "
            "still have to match"),
    Allowed("bad_invalid_utf8", "body.*",
            "vLLM answers a body that is not UTF-8 with FastAPI's {\"detail\": ...}, not the OpenAI error "
            "object it uses everywhere else; kvmeter answers the OpenAI error object (same status)"),
]
