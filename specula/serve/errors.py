"""Errors as the OpenAI API reports them: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

CLIENT_CLOSED = 499  # nginx's "client closed request": the client left, so nobody reads the answer


class APIError(Exception):
    """A request the server refuses or could not serve; `response()` is what the client receives."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())  # one line, as every specula error
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(message: str = "the server failed while generating; the request can be retried") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
