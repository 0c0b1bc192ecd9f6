"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, Anthropic's
(`{"type": "error", "error": {"type", "message"}}`, for the Messages routes), and the exception that
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

    def response(self, anthropic: bool = False) -> web.Response:
        if anthropic:
            return anthropic_error_response(self.message, status=self.status)
        return error_response(self.message, status=self.status, param=self.param, code=self.code, type=self.type)


def error_response(message: str, *, status: int, param: str | None = None, code: str | None = None,
                   type: str = "invalid_request_error") -> web.Response:
    """OpenAI's error body with the given HTTP status."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_response(message: str, *, status: int) -> web.Response:
    """Anthropic's error object with the given HTTP status (its `type` by status; 5xx: api_error)."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)
