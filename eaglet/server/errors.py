"""The server's refusals: an ``APIError`` raised anywhere in a request's handling becomes an OpenAI
error object ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from eaglet.server import protocol as P

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorBody(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)
