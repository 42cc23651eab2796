"""Reading a request body safely: media type, size cap, time limit, strict UTF-8, no lone
surrogates, JSON object."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import aclosing
from typing import Any

from starlette.requests import ClientDisconnect, Request

from kvmeter.serving.gateway.errors import ApiError

__all__ = ["read_json_object", "check_media_type", "single_header", "json_type", "InvalidJson", "CLIENT_CLOSED",
           "JSON_MEDIA_TYPES"]

log = logging.getLogger(__name__)

#: Status recorded for a client that went away before its response (nginx's 499; never sent).
CLIENT_CLOSED = 499

#: Media types read as JSON, besides ``application/*+json``. ``application/x-www-form-urlencoded``
#: is what ``curl -d`` sends when no ``-H 'Content-Type: ...'`` is given (the common way to try an
#: API by hand); its body is still parsed as JSON, so a real form body is a 400 ``invalid_json``.
#: A request without a Content-Type is read as JSON too. Any other explicit type (``text/plain``,
#: ``multipart/form-data``, ``application/xml``, ``application/octet-stream``...) is a 415.
JSON_MEDIA_TYPES = frozenset({"application/json", "application/x-www-form-urlencoded"})

#: A JSON escape of a UTF-16 surrogate: the only way a body that is valid UTF-8 can carry one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class InvalidJson(ApiError):
    """400 ``invalid_json``: the body is empty, not JSON, or not a JSON object.

    Attributes:
        loc: where FastAPI (vLLM's server) would place the error: ``("body", <character offset>)``
            for malformed JSON, ``("body",)`` otherwise.
    """

    def __init__(self, message: str, loc: tuple[Any, ...] = ("body",)) -> None:
        super().__init__(400, message, code="invalid_json")
        self.loc = loc


def json_type(value: Any) -> str:
    """The JSON type name of a parsed JSON value (for messages; never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (key or value) in ``value`` that holds a lone
    surrogate (valid JSON, but not text: UTF-8 cannot encode it, nor can a tokenizer), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _lone_surrogate(key, where) or _lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def single_header(request: Request, name: str, display: str, *, code: str) -> str:
    """The value of header ``name`` ("" when absent), sent once or repeated with one value.

    Raises:
        ApiError: 400 ``code`` (``param``: ``display``) when the header lines disagree: which one
            the client meant cannot be known, and picking one could run (and bill) the request
            under the wrong key.
    """
    values = request.headers.getlist(name)
    if len(set(values)) > 1:
        raise ApiError(400, f"{display} was sent {len(values)} times with different values; send it once",
                       param=display, code=code)
    return values[0] if values else ""


def check_media_type(request: Request) -> None:
    """Refuse an explicit non-JSON ``Content-Type`` (parameters such as ``charset`` are ignored).

    Raises:
        ApiError: 415 ``unsupported_media_type`` naming the type that was sent (at most 100
            characters of it); 400 when ``Content-Type`` is sent more than once with different
            values (which one the client meant cannot be known).
    """
    sent = single_header(request, "content-type", "Content-Type", code="invalid_request")
    ctype = sent.split(";")[0].strip().lower()
    if not ctype or ctype in JSON_MEDIA_TYPES or (ctype.startswith("application/") and ctype.endswith("+json")):
        return
    raise ApiError(415, f"Content-Type must be application/json, got {ctype[:100]!r}",
                   code="unsupported_media_type", param="Content-Type")


async def read_json_object(request: Request, max_bytes: int, *, timeout_s: float | None = None,
                           allow_empty: bool = False) -> dict:
    """Read and parse the body as a JSON object.

    Args:
        request: the Starlette request.
        max_bytes: the largest body accepted (bytes, ≥ 1).
        timeout_s: the longest the whole body may take to arrive, counted from the first read
            (seconds, > 0; None: no limit). A deadline for the whole body rather than between
            chunks, so a client trickling a byte at a time cannot hold the request either.
        allow_empty: answer ``{}`` for an empty body instead of a 400.
    Returns:
        The parsed object.
    Raises:
        ApiError: 415 for an explicit non-JSON Content-Type (see :func:`check_media_type`); 413 if
            the body (declared or actual) exceeds ``max_bytes``; 408 ``request_timeout`` (with
            ``Connection: close``) if the body did not arrive within ``timeout_s``, logged as one
            info line; 400 for an empty body, invalid UTF-8, malformed JSON (an integer of more
            than 4300 digits included), or JSON that is not an object; 499
            ``client_disconnected`` if the client closed the connection before sending the whole
            body (nothing to answer: the caller records it and sends nothing).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_n = int(declared)
        except ValueError:
            raise ApiError(400, "Content-Length is not a number", code="invalid_content_length") from None
        if declared_n > max_bytes:
            raise ApiError(413, f"request body is {declared_n} bytes; the limit is {max_bytes}",
                           code="request_too_large")
    check_media_type(request)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s), aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, f"client closed the connection after {size} bytes of the body",
                       code="client_disconnected") from None
    except TimeoutError:  # only our own deadline: a cancellation from outside stays CancelledError
        of = f" of {declared_n}" if declared is not None else ""
        log.info("%s %s: request body not received within %g s (%d%s bytes arrived); answered 408",
                 request.method, request.url.path, timeout_s, size, of)
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                            f"({size}{of} bytes received)",
                       code="request_timeout", headers={"connection": "close"}) from None
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}
        raise InvalidJson("request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})",
                       code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidJson(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                          ("body", exc.pos)) from None
    except RecursionError:
        raise InvalidJson("malformed JSON: nested too deeply") from None
    except ValueError:  # an integer literal past Python's int_max_str_digits (4300 digits)
        raise InvalidJson("malformed JSON: a number is too long") from None
    if not isinstance(data, dict):
        raise InvalidJson(f"request body must be a JSON object, got {json_type(data)}")
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(data, "")
        if where is not None:
            raise ApiError(400, f"{where} contains an invalid Unicode surrogate", param=where,
                           code="invalid_encoding")
    return data
