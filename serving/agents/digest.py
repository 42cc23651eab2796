"""Digests that bind decisions to what was asked: tool-call arguments and model-call prompts.

* :func:`canonical_json` — the JSON Canonicalization Scheme (RFC 8785, "JCS"): object members
  sorted by the UTF-16 code units of their names, no whitespace, strings with JSON's minimal
  escapes, numbers as ECMAScript writes an IEEE double (``1.0`` → ``1``, ``1e21`` → ``1e+21``,
  ``0.000001`` → ``0.000001``, ``1e-7`` → ``1e-7``; integers beyond 2**53 become the nearest double,
  as every JCS implementation reads them). Two argument objects that mean the same (key order,
  spacing, ``1`` vs ``1.0``) have one canonical form.
* :func:`arguments_digest` — hex SHA-256 of the canonical JSON of a tool call's arguments (an
  object, or the JSON text OpenAI puts in ``function.arguments``). Approvals, side-effect
  idempotency and loop detection compare these.
* :func:`prompt_digest` — hex SHA-256 of a model call's prompt token ids (what the engine reads,
  after the chat template), for the repeated-prompt stop.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import Any, Sequence

__all__ = ["canonical_json", "arguments_digest", "parse_arguments", "prompt_digest", "ArgumentsError"]

#: Largest arguments text accepted (characters).
MAX_ARGUMENTS_CHARS = 65_536


class ArgumentsError(ValueError):
    """Arguments that are not a JSON value kvmeter can digest (the message says why)."""


def _number(x: float) -> str:
    """An IEEE double as ECMAScript's ``Number.prototype.toString`` writes it (RFC 8785 §3.2.2.3)."""
    if not math.isfinite(x):
        raise ArgumentsError("NaN and Infinity are not JSON numbers")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    digits, _, exp = repr(abs(x)).partition("e")  # repr: the shortest digits that round-trip
    whole, _, frac = digits.partition(".")
    frac = "" if frac == "0" else frac
    s = (whole + frac).lstrip("0")
    # value = 0.s × 10^n, s without leading zeros
    n = len(whole.lstrip("0")) if whole.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    n += int(exp) if exp else 0
    s = s.rstrip("0") or "0"
    k = len(s)
    if k <= n <= 21:
        out = s + "0" * (n - k)
    elif 0 < n <= 21:
        out = s[:n] + "." + s[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * (-n) + s
    else:
        e = n - 1
        mantissa = s if k == 1 else s[0] + "." + s[1:]
        out = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + out


def _encode(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, int):
        out.append(str(value) if abs(value) <= 2 ** 53 else _number(float(value)))
    elif isinstance(value, float):
        out.append(_number(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value, key=lambda k: k.encode("utf-16-be", "surrogatepass"))):
            if not isinstance(key, str):
                raise ArgumentsError("object keys must be strings")
            if i:
                out.append(",")
            out.append(json.dumps(key, ensure_ascii=False))
            out.append(":")
            _encode(value[key], out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        raise ArgumentsError(f"{type(value).__name__} is not a JSON value")


def _plain(v: Any) -> bool:
    """True when the standard library's encoder writes ``v`` exactly as RFC 8785 does: no floats
    (ECMAScript number form), no integers beyond 2**53, only ASCII object keys (code-point order
    = UTF-16 order)."""
    t = type(v)
    if t is str or t is bool or v is None:
        return True
    if t is int:
        return -(2 ** 53) <= v <= 2 ** 53
    if t is dict:
        return all(type(k) is str and k.isascii() and _plain(x) for k, x in v.items())
    if t is list or t is tuple:
        return all(_plain(x) for x in v)
    return False


def canonical_json(value: Any) -> str:
    """The RFC 8785 canonical JSON text of ``value`` (dicts, lists, str, int, float, bool, None).

    Values without floats, big integers or non-ASCII keys (most tool arguments) go through the
    standard library's C encoder (sorted keys, no whitespace, the same string escapes); the rest
    through :func:`_encode`. Both give the same text (tests/serving/agents/test_digest.py checks it on
    generated values).

    Raises:
        ArgumentsError: a value JSON cannot hold (NaN, a non-string key, another type).
    """
    if _plain(value):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    out: list[str] = []
    _encode(value, out)
    return "".join(out)


def canonical_json_slow(value: Any) -> str:
    """:func:`canonical_json` always through kvmeter's own encoder (the reference for tests)."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out)


def parse_arguments(arguments: Any) -> Any:
    """The arguments of a tool call as a JSON value: ``None`` → ``{}``; a string is parsed as JSON
    (OpenAI's ``function.arguments``); anything else is taken as it is.

    Raises:
        ArgumentsError: a string that is not JSON, or longer than :data:`MAX_ARGUMENTS_CHARS`.
    """
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if len(arguments) > MAX_ARGUMENTS_CHARS:
            raise ArgumentsError(f"arguments longer than {MAX_ARGUMENTS_CHARS} characters")
        try:
            return json.loads(arguments, parse_constant=_refuse_constant)
        except ValueError as exc:
            raise ArgumentsError(f"arguments are not JSON: {exc}") from None
    return arguments


def _refuse_constant(name: str) -> Any:
    raise ArgumentsError(f"{name} is not a JSON number")


def arguments_digest(arguments: Any) -> str:
    """Hex SHA-256 (64 characters) of the canonical JSON of a tool call's arguments.

    Args:
        arguments: a JSON value, a JSON text (parsed first) or ``None`` (= ``{}``).
    Raises:
        ArgumentsError: see :func:`parse_arguments` and :func:`canonical_json`.
    """
    return hashlib.sha256(canonical_json(parse_arguments(arguments)).encode("utf-8", "surrogatepass")).hexdigest()


def prompt_digest(prompt_token_ids: Sequence[int]) -> str:
    """Hex SHA-256 of a prompt's token ids (each as an unsigned 32-bit little-endian integer).

    Raises:
        struct.error: a token id outside 0 .. 2**32 − 1.
    """
    return hashlib.sha256(struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)).hexdigest()
