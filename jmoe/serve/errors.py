"""Every HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

400 for a bad request (malformed JSON, a wrong type, a value out of range, what the server cannot serve, a
field nobody defines under --strict-fields: never FastAPI's raw 422), 401 without the API key, 404 for an
unknown model or path, 503 with Retry-After while loading, shutting down or when the queue is full, 500 when
generation itself failed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jmoe.errors import InputError
from jmoe.serve.params import RequestError

# Fields whose alternatives pydantic reports one by one: one sentence says what each may be instead.
FIELD_FORMS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of up to 64 strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


class ApiError(Exception):
    """An error response: HTTP status, OpenAI's error fields, and Retry-After seconds for a 503."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, error: ApiError):
        return error.response()

    async def bad_value(request: Request, error: InputError):
        param = error.param if isinstance(error, RequestError) else "prompt"
        return ApiError(400, str(error), "invalid_request_error", param).response()

    async def invalid_body(request: Request, error: RequestValidationError):
        return validation_error(error.errors()).response()

    async def http_error(request: Request, error: HTTPException):
        return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                        "invalid_request_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(InputError, bad_value)  # RequestError and the engine's checks of token ids
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)


def validation_error(errors: list[dict]) -> ApiError:
    """The 400 of a body pydantic rejected, naming the first problem's field."""
    first = errors[0]
    loc = [str(p) for p in first["loc"][1:] if isinstance(p, int) or "[" not in str(p) and p not in _TYPE_TAGS]
    param = ".".join(loc) or None
    if first["type"] == "json_invalid":  # its loc is a character offset, not a field
        param = None
        message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    elif not loc:
        message = (f"the body must be a JSON object sent with the header Content-Type: application/json, found "
                   f"{_found(first.get('input'))}")
    elif first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}: this server does not support it; remove it"
    elif first["type"] == "missing":
        message = f"{param} is required"
    elif loc[-1] in FIELD_FORMS or (len(loc) > 1 and loc[-2] in FIELD_FORMS):
        field = loc[-1] if loc[-1] in FIELD_FORMS else loc[-2]
        message = f"{param} must be {FIELD_FORMS[field]}, found {_found(first.get('input'))}"
    else:
        message = f"{param}: {first['msg'].lower()}, found {_found(first.get('input'))}"
    return ApiError(400, message, "invalid_request_error", param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _found(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
