"""Reading a request body safely: size cap, strict UTF-8, JSON object."""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request

from kvmeter.serving.gateway.errors import ApiError

__all__ = ["read_json_object", "CLIENT_CLOSED"]

#: Status recorded for a client that went away before its response (nginx's 499; never sent).
CLIENT_CLOSED = 499


async def read_json_object(request: Request, max_bytes: int) -> dict:
    """Read and parse the body as a JSON object.

    Args:
        request: the Starlette request.
        max_bytes: the largest body accepted (bytes, ≥ 1).
    Returns:
        The parsed object.
    Raises:
        ApiError: 413 if the body (declared or actual) exceeds ``max_bytes``; 415 for a multipart
            body; 400 for an empty body, invalid UTF-8, malformed JSON (an integer of more
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
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype.startswith("multipart/"):  # anything else is tried as JSON (curl -d sends form type)
        raise ApiError(415, f"content-type must be application/json, got {ctype!r}",
                       code="unsupported_media_type")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, f"client closed the connection after {size} bytes of the body",
                       code="client_disconnected") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})",
                       code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply", code="invalid_json") from None
    except ValueError:  # an integer literal past Python's int_max_str_digits (4300 digits)
        raise ApiError(400, "malformed JSON: a number is too long", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    return data
