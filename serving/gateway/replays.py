"""Idempotent retries at the HTTP edge: fingerprints, replayed responses, captured streams.

The logic of who runs and who replays lives in :mod:`kvmeter.serving.quota.idempotency`; this
module only turns its tickets into HTTP: a request fingerprint (so a key reused with a different
body is refused), the byte-for-byte replay of a stored response, and a tee that captures a stream
as it is sent so it can be stored when — and only if — it completes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from starlette.responses import Response

from kvmeter.serving.gateway.errors import ApiError
from kvmeter.serving.quota.idempotency import IdempotencyTicket, StoredResponse

__all__ = ["fingerprint", "replay_response", "REPLAY_HEADER", "stored_headers"]

#: Header added to a response served from an earlier attempt's stored result.
REPLAY_HEADER = "x-kvmeter-idempotent-replay"

#: Headers that belong to one attempt and are not replayed.
_PER_ATTEMPT = {"content-length", "date", "server", "transfer-encoding"}


def fingerprint(body: dict[str, Any], endpoint: str) -> str:
    """SHA-256 of the endpoint and the parsed body in canonical form (sorted keys), so whitespace
    or key order do not make a retry look like a different request."""
    canonical = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(endpoint.encode() + b"\n" + canonical).hexdigest()


def stored_headers(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The headers worth replaying, as ``(name, value)`` pairs."""
    return tuple((k, v) for k, v in headers.items() if k.lower() not in _PER_ATTEMPT)


def replay_response(ticket: IdempotencyTicket) -> Response:
    """The stored response of an earlier attempt, byte for byte, marked as a replay.

    Raises:
        ApiError: 409 when the stored result kept no body (it exceeded the store's size cap) —
            running the request again would bill it twice.
    """
    stored: StoredResponse | None = ticket.response
    if stored is None or stored.body_omitted:
        raise ApiError(409, "the first attempt with this Idempotency-Key finished, but its response "
                            "was too large to keep for replay; it will not be run again",
                       code="idempotent_response_unavailable")
    headers = {k: v for k, v in stored.headers}
    headers[REPLAY_HEADER] = "true"
    headers["x-kvmeter-attempt"] = str(ticket.attempt)
    media = "text/event-stream" if stored.streamed else headers.pop("content-type", "application/json")
    headers.pop("content-type", None)
    return Response(stored.body, status_code=stored.status_code, headers=headers, media_type=media)
