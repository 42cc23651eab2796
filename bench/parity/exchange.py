"""Send one parity case to one server and record the answer as plain data.

An :class:`Answer` holds the HTTP status, the response headers (names lower-cased), and the body
parsed by its content type: a JSON value (``application/json``), the list of server-sent events
(``text/event-stream``: each event's ``data`` parsed as JSON, or the string ``"[DONE]"``), or the
text. A transport failure (connection refused, timeout, a stream cut short) is recorded in
``transport_error`` instead of raising, so one broken case cannot stop the table.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.parity.cases import Case

__all__ = ["Answer", "send", "parse_sse"]

#: SSE ``data`` payload that ends an OpenAI stream
DONE = "[DONE]"


@dataclass
class Answer:
    """One server's answer to one case.

    Attributes:
        status: HTTP status (0 if no response arrived).
        headers: response headers, names lower-cased (a repeated name: values joined by ``", "``).
        kind: ``json``, ``sse``, ``text`` or ``none`` (no response).
        body: the parsed JSON value, the list of SSE events, or the text.
        transport_error: what went wrong on the wire, else ``None``.
        elapsed_s: wall time of the exchange (seconds).
    """

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    kind: str = "none"
    body: Any = None
    transport_error: str | None = None
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_sse(text: str) -> list[Any]:
    """The events of an SSE body: each event's ``data`` lines joined by newlines and parsed as
    JSON (``"[DONE]"`` stays a string; data that is not JSON becomes ``{"<unparsed>": text}``); an
    event with an ``event:`` name becomes ``{"event": name, "data": ...}``. Comment lines
    (``: ...``, keep-alives) are dropped. The spec: https://html.spec.whatwg.org/multipage/server-sent-events.html
    """
    events: list[Any] = []
    data: list[str] = []
    name: str | None = None

    def flush() -> None:
        nonlocal data, name
        if data:
            raw = "\n".join(data)
            if raw == DONE:
                value: Any = DONE
            else:
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = {"<unparsed>": raw}
            events.append({"event": name, "data": value} if name else value)
        data, name = [], None

    for line in text.replace("\r\n", "\n").split("\n"):
        if line == "":
            flush()
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "data":
                data.append(value)
            elif key == "event":
                name = value
    flush()
    return events


def _headers(resp: httpx.Response) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in resp.headers.multi_items():
        name = name.lower()
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def _parse(content_type: str, raw: bytes) -> tuple[str, Any]:
    text = raw.decode("utf-8", errors="replace")
    if content_type.startswith("text/event-stream"):
        return "sse", parse_sse(text)
    try:
        return "json", json.loads(text)
    except ValueError:
        return "text", text


def send(client: httpx.Client, base_url: str, case: Case, api_key: str, timeout_s: float = 300.0) -> Answer:
    """POST ``case`` to ``base_url`` and read the whole answer (a stream to its end).

    The request carries ``content-type: application/json``, ``authorization: Bearer api_key`` and
    the case's own headers; a dict body is serialised with :func:`json.dumps`, ``bytes`` are sent
    unchanged.
    """
    headers = {"content-type": "application/json", "authorization": f"Bearer {api_key}", **case.headers}
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    t0 = time.perf_counter()
    try:
        with client.stream("POST", f"{base_url}{case.endpoint}", content=content, headers=headers,
                           timeout=httpx.Timeout(timeout_s, connect=10)) as resp:
            raw = resp.read()
            kind, body = _parse(resp.headers.get("content-type", ""), raw)
            return Answer(resp.status_code, _headers(resp), kind, body, None, time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        return Answer(0, {}, "none", None, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)
