"""Field-by-field comparison of two servers' answers to one parity case.

Each :class:`~bench.parity.exchange.Answer` is first reduced to a comparable *view*
(:func:`view`): the HTTP status, the compared response headers, the body's kind and the body,
with the values that legitimately differ between two runs replaced by placeholders:

===============================  ==========================================================
field                            placeholder
===============================  ==========================================================
``id`` of a response or chunk    ``chatcmpl-<id:N>`` / ``cmpl-<id:N>`` (the prefix is kept);
                                 ``chatcmpl-<x-request-id>`` when it is the client's
                                 ``X-Request-Id`` (vLLM builds the id from it)
``id`` of a tool call            ``<tool_call_id:N>``
``created``                      ``<created>`` (only an integer: a string stays and differs)
``system_fingerprint``           ``<system_fingerprint>`` (whatever the value; presence counts)
``usage…cached_tokens``          ``<cached_tokens>`` (an integer ≥ 0: it depends on the prefix
                                 cache's state, i.e. on what the server ran before)
``x-request-id`` header          ``<random>`` when the client sent none; compared exactly
                                 when it did
===============================  ==========================================================

``N`` numbers distinct values in order of first appearance, so a stream whose chunks all carry
one id still compares equal to another such stream, while a stream whose chunks disagree does not.

Then :func:`diff` walks both views and lists every :class:`Difference` with its dotted path
(``body.choices.0.message.content``, ``body.3.choices.0.delta`` for the fourth SSE event,
``headers.content-type``, ``status``) — dots, not brackets, so allow-list patterns are plain
:mod:`fnmatch` globs. Numbers compare exactly (``1`` and ``1.0`` are equal, as in JSON; ``true``
is not ``1``).

Streams: the event sequences are compared event by event. vLLM's engine client merges the
outputs of several engine steps into one chunk when the reader lags (``RequestOutputCollector``),
so chunk boundaries are not deterministic on a busy machine; when two streams differ event by
event, both are merged (:func:`merge_chunks`: consecutive chunks of one choice joined, their
texts, tool-call arguments and logprobs concatenated, the later chunk's ``finish_reason``,
``usage`` and ``system_fingerprint`` kept — vLLM stamps the fingerprint on the terminal chunk only,
so a terminal chunk that also carries the last tokens on one side merges with the tokens' chunks of
the other) and compared again; if the merged streams are equal the case is ``same`` with
the note that its chunking differs. A stream of several choices (``n > 1``) whose choices'
chunks interleave differently (which choice's chunk of an engine step the reader gets first moves
with the same lag) is compared once more with each choice's chunks gathered in order
(:func:`by_choice`, then merged): each chunk names its choice's ``index``, so no client depends on
the interleaving; every choice's text, finish reason and the usage must still be equal.

Compared headers (:data:`COMPARED_HEADERS`): ``content-type`` and ``x-request-id``; kvmeter's own
(``x-ratelimit-*``, ``x-kvmeter-*``, ``retry-after``) and transport headers (``date``, ``server``,
``content-length``) are not part of the OpenAI surface and are left aside.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from bench.parity.cases import Case
from bench.parity.exchange import Answer

__all__ = ["Difference", "Allowed", "CaseResult", "COMPARED_HEADERS", "MISSING", "view", "diff",
           "compare_case", "request_id_of", "merge_chunks", "by_choice"]

#: response headers that are part of the OpenAI surface both servers must agree on
COMPARED_HEADERS = ("content-type", "x-request-id")
#: how an absent key or list item is shown in a difference
MISSING = "<missing>"
_ID_RE = re.compile(r"^(chatcmpl|cmpl)-(.+)$", re.S)


@dataclass(frozen=True)
class Difference:
    """One field where the answers differ: its dotted ``path``, vLLM's (reference) value and the
    target's (normalised; :data:`MISSING` where one side lacks it)."""

    path: str
    reference: Any
    target: Any

    def short(self, width: int = 80) -> str:
        def cut(v: Any) -> str:
            s = repr(v)
            return s if len(s) <= width else s[: width - 1] + "…"
        return f"{self.path}: {cut(self.reference)} ≠ {cut(self.target)}"


@dataclass(frozen=True)
class Allowed:
    """An allow-list entry: a difference whose case name matches ``case`` and whose path matches
    ``path`` (both :mod:`fnmatch` globs) does not fail the case; ``reason`` says why."""

    case: str
    path: str
    reason: str

    def covers(self, case_name: str, diff: Difference) -> bool:
        return fnmatch.fnmatchcase(case_name, self.case) and fnmatch.fnmatchcase(diff.path, self.path)


@dataclass
class CaseResult:
    """The verdict on one case.

    Attributes:
        verdict: ``same`` (no difference), ``allowed`` (only allow-listed differences) or
            ``different`` (at least one difference not on the allow-list).
        differences: the differences not allowed.
        allowed: ``(difference, reason)`` for the allow-listed ones.
        note: what the reader should know (e.g. that only the streams' chunking differs).
    """

    name: str
    reference_status: int
    target_status: int
    verdict: str
    differences: list[Difference] = field(default_factory=list)
    allowed: list[tuple[Difference, str]] = field(default_factory=list)
    note: str = ""


def request_id_of(case: Case) -> str | None:
    """The ``X-Request-Id`` the case sends, if any (header names are case-insensitive)."""
    for name, value in case.headers.items():
        if name.lower() == "x-request-id":
            return value
    return None


class _Placeholders:
    """Numbers distinct values per kind in order of first appearance."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}

    def __call__(self, kind: str, value: str) -> str:
        n = self._seen.setdefault((kind, value), sum(1 for k, _ in self._seen if k == kind) + 1)
        return f"<{kind}:{n}>"


def _response_id(value: Any, rid: str | None, ph: _Placeholders) -> Any:
    if not isinstance(value, str):
        return value
    m = _ID_RE.match(value)
    if m is None:
        return ph("id", value)
    prefix, rest = m.groups()
    if rid is not None and rest == rid:
        return f"{prefix}-<x-request-id>"
    return f"{prefix}-{ph('id', rest)}"


def _normalise(node: Any, rid: str | None, ph: _Placeholders, *, root: bool, parent_key: str | None) -> Any:
    if isinstance(node, list):
        return [_normalise(v, rid, ph, root=False, parent_key=parent_key) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "id" and root:
            out[key] = _response_id(value, rid, ph)
        elif key == "id" and parent_key == "tool_calls" and isinstance(value, str):
            out[key] = ph("tool_call_id", value)
        elif key == "created" and root and type(value) is int:
            out[key] = "<created>"
        elif key == "system_fingerprint" and root:
            out[key] = "<system_fingerprint>"
        elif key == "cached_tokens" and parent_key == "prompt_tokens_details" and type(value) is int and value >= 0:
            out[key] = "<cached_tokens>"
        else:
            out[key] = _normalise(value, rid, ph, root=False, parent_key=key)
    return out


def view(answer: Answer, case: Case) -> dict[str, Any]:
    """The comparable view of ``answer`` (see the module docstring for what is normalised)."""
    rid = request_id_of(case)
    ph = _Placeholders()
    headers: dict[str, Any] = {}
    for name in COMPARED_HEADERS:
        if name in answer.headers:
            value = answer.headers[name]
            if name == "x-request-id" and rid is None:
                value = "<random>"
            headers[name] = value
    if answer.kind == "sse":
        body = [_normalise(event, rid, ph, root=True, parent_key=None) for event in answer.body]
    else:
        body = _normalise(answer.body, rid, ph, root=True, parent_key=None)
    out = {"status": answer.status, "headers": headers, "kind": answer.kind, "body": body}
    if answer.transport_error:
        out["transport_error"] = answer.transport_error
    return out


def _same_scalar(a: Any, b: Any) -> bool:
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def diff(reference: Any, target: Any, path: str = "") -> list[Difference]:
    """Every difference between two views (or any two JSON values), depth first, keys in the
    reference's order then the target's extra keys."""
    out: list[Difference] = []
    _diff(reference, target, path, out)
    return out


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _diff(a: Any, b: Any, path: str, out: list[Difference]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            p = _join(path, key)
            if key not in b:
                out.append(Difference(p, a[key], MISSING))
            elif key not in a:
                out.append(Difference(p, MISSING, b[key]))
            else:
                _diff(a[key], b[key], p, out)
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            p = _join(path, i)
            if i >= len(b):
                out.append(Difference(p, a[i], MISSING))
            elif i >= len(a):
                out.append(Difference(p, MISSING, b[i]))
            else:
                _diff(a[i], b[i], p, out)
    elif not _same_scalar(a, b):
        out.append(Difference(path, a, b))


#: string fields whose pieces a merged chunk concatenates (delta texts, tool-call arguments,
#: completions text)
_CONCAT = frozenset({"content", "reasoning", "reasoning_content", "refusal", "arguments", "text", "name"})
#: per-choice keys the later chunk of a merged pair decides
_LATEST = frozenset({"finish_reason", "stop_reason"})


def _merge_tool_calls(a: list, b: list) -> list:
    out = [dict(x) for x in a]
    for call in b:
        idx = call.get("index") if isinstance(call, dict) else None
        same = next((x for x in out if isinstance(x, dict) and x.get("index") == idx), None)
        if idx is None or same is None:
            out.append(call)
        else:
            out[out.index(same)] = _merge_values(same, call, "tool_call")
    return out


def _merge_values(a: Any, b: Any, key: str | None) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if key == "tool_calls" and isinstance(a, list) and isinstance(b, list):
        return _merge_tool_calls(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = v if k in _LATEST else _merge_values(a.get(k), v, k)
        return out
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, str) and isinstance(b, str) and key in _CONCAT:
        return a + b
    return b


def _mergeable(prev: Any, cur: Any) -> bool:
    if not (isinstance(prev, dict) and isinstance(cur, dict)):
        return False
    pc, cc = prev.get("choices"), cur.get("choices")
    if not (isinstance(pc, list) and isinstance(cc, list) and len(pc) == len(cc) == 1):
        return False
    p, c = pc[0], cc[0]
    if not (isinstance(p, dict) and isinstance(c, dict)) or p.get("index") != c.get("index"):
        return False
    if p.get("finish_reason") is not None:
        return False
    if any(isinstance(x.get("delta"), dict) and "role" in x["delta"] for x in (p, c)):
        return False  # the role chunk opens a chat stream on its own
    # vLLM stamps ``system_fingerprint`` on a stream's terminal chunk only (the one with its
    # finish_reason, when the client asked no usage): like finish_reason, the later chunk decides it
    rest = lambda e: {k: v for k, v in e.items() if k not in ("choices", "usage", "system_fingerprint")}  # noqa: E731
    return rest(prev) == rest(cur)


def merge_chunks(events: list[Any]) -> list[Any]:
    """``events`` with each run of consecutive chunks of one choice merged into one chunk (see
    the module docstring); other events (the role chunk, usage-only chunks, ``[DONE]``) stay."""
    out: list[Any] = []
    for event in events:
        if out and _mergeable(out[-1], event):
            prev = out[-1]
            merged = dict(prev)
            merged["choices"] = [_merge_values(prev["choices"][0], event["choices"][0], None)]
            for k in ("finish_reason", "stop_reason"):
                if k in event["choices"][0]:
                    merged["choices"][0][k] = event["choices"][0][k]
            for k in ("usage", "system_fingerprint"):
                if k in event:
                    merged[k] = event[k]
            out[-1] = merged
        else:
            out.append(event)
    return out


def by_choice(events: list[Any]) -> list[Any]:
    """``events`` with the one-choice chunks gathered by choice ``index`` (stable: each choice's
    chunks keep their order), choice 0 first; every other event (usage-only chunks, ``[DONE]``)
    after them, in its order."""
    def key(event: Any) -> tuple[int, int]:
        choices = event.get("choices") if isinstance(event, dict) else None
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict) \
                and isinstance(choices[0].get("index"), int):
            return (0, choices[0]["index"])
        return (1, 0)
    return sorted(events, key=key)


def compare_case(case: Case, reference: Answer, target: Answer, allowlist: Iterable[Allowed] = ()) -> CaseResult:
    """Compare the two answers to ``case``; differences covered by ``allowlist`` are set aside
    with their reason. Two streams that differ event by event but not once merged
    (:func:`merge_chunks`) are compared merged."""
    entries = list(allowlist)
    result = CaseResult(case.name, reference.status, target.status, "same")
    ref, tgt = view(reference, case), view(target, case)
    differences = diff(ref, tgt)
    if differences and ref["kind"] == tgt["kind"] == "sse":
        merged_ref = {**ref, "body": merge_chunks(ref["body"])}
        merged_tgt = {**tgt, "body": merge_chunks(tgt["body"])}
        merged = diff(merged_ref, merged_tgt)
        note = "chunk boundaries differ"
        if any(d.path.startswith("body.") for d in merged):
            merged = diff({**ref, "body": merge_chunks(by_choice(ref["body"]))},
                          {**tgt, "body": merge_chunks(by_choice(tgt["body"]))})
            note = "chunk boundaries and the interleaving of choices differ"
        if len(merged) < len(differences) and all(not d.path.startswith("body.") for d in merged):
            result.note = (f"{note} ({len(ref['body'])} vs {len(tgt['body'])} events); "
                           "the merged streams are equal")
            differences = merged
    for d in differences:
        entry = next((e for e in entries if e.covers(case.name, d)), None)
        if entry is None:
            result.differences.append(d)
        else:
            result.allowed.append((d, entry.reason))
    if result.differences:
        result.verdict = "different"
    elif result.allowed:
        result.verdict = "allowed"
    return result
