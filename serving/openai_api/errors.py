"""vLLM's error answers, as :class:`~kvmeter.errors.Refusal` objects the gateway sends unchanged.

An error vLLM's own OpenAI server would also produce gets vLLM's body exactly:
``{"error": {"message", "type", "param", "code"}}`` with vLLM's ``type`` (``BadRequestError``,
``NotFoundError``, ``Bad Request`` for a body that fails validation, ...) and the HTTP status as
the integer ``code`` — built by vLLM's own ``create_error_response`` for exceptions and
``ErrorResponse`` objects, and as vLLM's ``validation_exception_handler`` builds it for a
pydantic ``ValidationError`` (``param`` the cleaned ``body.<field>`` path), except that the
message never echoes the offending value (kvmeter's hostile-input rule: each error is listed
with its type, place and pydantic's message, without its ``input``).

Each :class:`OpenAIError` also carries a kvmeter ``code`` from
:data:`~kvmeter.stats.REFUSAL_CODES` (``invalid_value``, ``model_not_found``,
``context_length_exceeded``, ``unsupported_parameter``, ``invalid_json``) for the refusal
metrics and the attempt record; the client never sees it.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Sequence

from kvmeter.errors import Refusal

__all__ = ["OpenAIError", "from_exception", "from_error_response", "from_validation_error",
           "invalid_body", "unsupported", "model_not_found"]

#: Most validation errors listed in one message (vLLM's ``_MAX_REPORTED_ERRORS``).
MAX_REPORTED_ERRORS = 10


class OpenAIError(Refusal):
    """A refusal answered with vLLM's error body.

    Args:
        body: the whole JSON body (``{"error": {...}}``), as vLLM's server sends it.
        code: kvmeter's classification (a :data:`~kvmeter.stats.REFUSAL_CODES` member).
    """

    def __init__(self, body: dict[str, Any], *, code: str) -> None:
        error = body["error"]
        super().__init__(str(error.get("message", "")), status_code=int(error["code"]), code=code,
                         param=error.get("param"))
        self._body = body

    def error_body(self) -> dict[str, Any]:
        """The JSON body the client gets (vLLM's)."""
        return self._body


def _classify(status: int, message: str, param: str | None) -> str:
    if status == HTTPStatus.NOT_FOUND:
        return "model_not_found" if param == "model" or "model" in message.lower() else "not_found"
    if status == HTTPStatus.NOT_IMPLEMENTED:
        return "unsupported_parameter"
    if status >= 500:
        return "other"
    text = message.lower()
    if "context length" in text or param == "input_tokens" or "max_model_len" in text:
        return "context_length_exceeded"
    return "invalid_value"


def from_error_response(response: Any) -> OpenAIError:
    """An ``ErrorResponse`` (vLLM's serving layer returned it) as a refusal."""
    body = response.model_dump()
    error = body["error"]
    return OpenAIError(body, code=_classify(int(error["code"]), str(error["message"]), error.get("param")))


def from_exception(exc: BaseException) -> OpenAIError:
    """What vLLM's server answers for ``exc`` raised by its serving layer (its
    ``create_error_response``: a ``VLLMValidationError`` is a 400 naming its parameter, a
    ``ValueError`` a 400, ``NotImplementedError`` a 501, anything else a 500)."""
    from vllm.entrypoints.serve import create_error_response

    return from_error_response(create_error_response(exc))  # type: ignore[arg-type]


def _vllm_body(message: str, err_type: str, status: int, param: str | None) -> dict[str, Any]:
    from vllm.entrypoints.serve.exception_handling.utils import sanitize_message

    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param,
                      "code": status}}


def from_validation_error(exc: Any) -> OpenAIError:
    """A pydantic ``ValidationError`` of the request body, answered as vLLM's
    ``validation_exception_handler`` answers FastAPI's (every ``loc`` under ``body``): status 400,
    type ``Bad Request``, ``param`` the first error's cleaned path, or the parameter of a
    ``VLLMValidationError`` raised by a validator; the message lists the errors without their
    input values."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
    from vllm.exceptions import VLLMValidationError

    errors = exc.errors(include_url=False, include_input=False)
    for error in errors:
        error["loc"] = ("body", *error.get("loc", ()))
    param = None
    for error in errors:
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, VLLMValidationError):
            param = ctx_error.parameter
            break
    if param is None and errors:
        param = clean_loc_for_param(tuple(errors[0]["loc"]))
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = []
    for error in errors[:MAX_REPORTED_ERRORS]:
        shown = {"type": error.get("type"), "loc": clean_loc_for_param(tuple(error["loc"])),
                 "msg": error.get("msg")}
        lines.append(f"  {shown}\n")
    message = f"{count} validation {label}:\n" + "".join(lines)
    if count > MAX_REPORTED_ERRORS:
        message += f"  ...and {count - MAX_REPORTED_ERRORS} more {label}\n"
    return OpenAIError(_vllm_body(message.rstrip(), HTTPStatus.BAD_REQUEST.phrase, 400, param),
                       code="invalid_value")


def invalid_body(message: str, loc: tuple[Any, ...]) -> OpenAIError:
    """A body that is not JSON, or not a JSON object, answered as vLLM's server answers it (FastAPI
    reports it as a validation error at ``loc``: ``("body", <character offset>)`` for malformed
    JSON, ``("body",)`` for an empty body or one that is not an object); ``message`` is kvmeter's."""
    return OpenAIError(_vllm_body(f"1 validation error:\n  {message}", HTTPStatus.BAD_REQUEST.phrase, 400,
                                  ".".join(str(p) for p in loc)), code="invalid_json")


def unsupported(message: str, param: str) -> OpenAIError:
    """A parameter kvmeter cannot honour, in vLLM's shape (400 ``BadRequestError`` naming it)."""
    return OpenAIError(_vllm_body(message, "BadRequestError", 400, param), code="unsupported_parameter")


def model_not_found(model: str, served: Sequence[str] = ()) -> OpenAIError:
    """vLLM's 404 for a model it does not serve (its ``OpenAIServingModels.check_model``), its
    message naming the ``served`` models (what ``GET /v1/models`` lists) in vLLM's words when given."""
    from vllm.entrypoints.serve import create_error_response

    message = f"The model `{model}` does not exist."
    if served:
        message += " Valid aliases: " + ", ".join(served) + "."
    return from_error_response(create_error_response(message, "NotFoundError", HTTPStatus.NOT_FOUND, "model"))
