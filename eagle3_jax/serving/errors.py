"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the exception that
carries one out of a handler: 400 for malformed requests, 404 for an unknown model or route, 500 /
503 when the engine fails."""

from __future__ import annotations

from ..runtime.extras import require

web = require("aiohttp.web", "serve", "the OpenAI server")


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def response(self) -> web.Response:
        return error_response(self.message, status=self.status, param=self.param, code=self.code, type=self.type)


def error_response(message: str, *, status: int, param: str | None = None, code: str | None = None,
                   type: str = "invalid_request_error") -> web.Response:
    """OpenAI's error body with the given HTTP status."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status)
