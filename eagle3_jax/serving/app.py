"""The OpenAI-compatible HTTP application (aiohttp) over an `AsyncEngine`.

Routes: `POST /v1/completions` (completions.py), `POST /v1/chat/completions` (chat.py),
`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages API on the chat
path, anthropic.py; its errors in Anthropic's shape), `POST /v1/responses` (OpenAI's Responses API,
stateless, on the chat path, responses.py), `GET /v1/models`, `GET /health` (200 while the engine runs, 503 when it stopped), `GET /metrics`
(Prometheus text format, metric names prefixed `eagle3_`; metrics.py). Each request is parsed into
a typed request (protocol.py, fields.py), run as the engine's choices (choices.py) and answered by
per-choice delivery (delivery.py), streamed or whole. The server sees the engine only through
`AsyncEngine`: it never touches the scheduler.

What the server changes or skips in a request is announced, never silent: a `warnings` list in
the (non-streamed) response body and the `X-Eagle3-Warnings` header on every answer. Errors use
OpenAI's body (errors.py). Run the app with `handler_cancellation=True` (as `scripts/serve.py`
does) so that a client leaving before its first token has its request aborted at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from typing import Callable, Sequence

from ..parsers import OutputParsing
from ..parsers.forced import unspellable_markers
from ..text.chat_template import ChatTemplate
from .anthropic import count_tokens, messages
from .async_engine import AsyncEngine, EngineDeadError, EngineError
from .chat import chat_completions
from .completions import completions
from .errors import ApiError, error_response, web
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics
from .protocol import Limits
from .responses import responses
from .state import ServerState

logger = logging.getLogger(__name__)

_STATE_KEY: web.AppKey[ServerState] = web.AppKey("eagle3_server", ServerState)


def make_app(engine: AsyncEngine, model_name: str, *, max_seq_len: int | None = None,
             eos_token_ids: Sequence[int] | None = None, tokenizer_dir: str | os.PathLike | None = None,
             default_max_tokens: int = 16, client_max_size: int = 8 * 2**20,
             chat_template: ChatTemplate | None = None, allow_synthetic_acceptance: bool = False,
             tool_call_parser: str | None = None, reasoning_parser: str | None = None,
             api_key: str | None = None) -> web.Application:
    """The aiohttp application serving `engine` (built with its tokenizer) under the OpenAI API as
    `model_name`.

    `max_seq_len` defaults to the engine's; `eos_token_ids` (where requests stop unless
    `ignore_eos`) to the tokenizer's. `chat_template` renders chat requests (default: the one in
    `tokenizer_dir`, else the tokenizer's folder's; without one, chat requests are refused, see
    `ChatTemplate`).
    `default_max_tokens` is the completions default (OpenAI's is 16). The caller starts and closes
    the engine. `allow_synthetic_acceptance` lets requests force speculative acceptance
    (benchmarking only). `tool_call_parser` and `reasoning_parser` (names as vLLM's, see
    `eagle3_jax.parsers`; None: off) turn chat outputs into `tool_calls` and `reasoning_content`;
    an unknown name raises ParserError. With `api_key`, /v1 routes answer 401 unless the request
    carries it as `Authorization: Bearer <key>` or `x-api-key: <key>`.
    """
    if engine.tokenizer is None:
        raise ValueError("the server needs the engine's tokenizer: AsyncEngine(scheduler, tokenizer=load_tokenizer(...))")
    tok = engine.tokenizer
    limits = Limits(max_seq_len=engine.max_seq_len if max_seq_len is None else int(max_seq_len),
                    max_logprobs=engine.max_logprobs,
                    eos_token_ids=tuple(int(t) for t in (tok.eos_ids if eos_token_ids is None else eos_token_ids)),
                    default_max_tokens=int(default_max_tokens), allow_synthetic_acceptance=bool(allow_synthetic_acceptance))
    parsing = OutputParsing(tool_call_parser, reasoning_parser)  # ParserError for an unknown name
    _check_markup(parsing, tok)
    if chat_template is None:
        chat_template = ChatTemplate.from_dir(tokenizer_dir) if tokenizer_dir is not None else tok.chat_template
    state = ServerState(engine, tok, model_name, limits, chat_template, parsing)
    def thread_roles() -> dict[int, str]:  # called while /metrics renders, on the event loop's thread
        roles = {threading.get_native_id(): "event_loop"}
        if engine.thread_id is not None:
            roles[engine.thread_id] = "engine"
        return roles

    metrics = ServerMetrics(engine.stats, thread_roles)
    app = web.Application(middlewares=[_middleware(metrics, api_key)], client_max_size=client_max_size)
    app[_STATE_KEY] = state
    routes = (("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat_completions),
              ("POST", "/v1/messages", messages), ("POST", "/v1/messages/count_tokens", count_tokens),
              ("POST", "/v1/responses", responses),
              ("GET", "/v1/models", _models), ("GET", "/health", _health), ("GET", "/ready", _ready))
    for method, path, handler in routes:
        app.router.add_route(method, path, _with_state(handler))

    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    app.router.add_get("/metrics", scrape)
    return app


def _check_markup(parsing: OutputParsing, tokenizer) -> None:
    """Say at start-up, in one line, when the tool-call parser's markers cannot be written by this
    tokenizer: such calls parse, but a forced call (`tool_choice` required or named) is refused."""
    if parsing.tool_calls is None:
        return
    unspellable = unspellable_markers(parsing.tool_calls, tokenizer)
    if unspellable:
        logger.warning("--tool_call_parser=%s: this tokenizer cannot write its marker(s) %s, so requests forcing a "
                       "call (tool_choice required or named) are refused; is it this model's family's parser?",
                       parsing.tool_calls.name, ", ".join(map(repr, unspellable)))


def _with_state(handler: Callable) -> Callable:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handler(request, request.app[_STATE_KEY])
    return handle


def _middleware(metrics: ServerMetrics, api_key: str | None) -> Callable:
    """The key check, error bodies for every failure (Anthropic's on its routes, else OpenAI's), and
    request counts for /metrics."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        resource = getattr(request.match_info.route, "resource", None)
        route = resource.canonical if resource is not None else "other"  # unmatched paths share one label
        try:
            if api_key is not None and request.path.startswith("/v1/") and not _has_key(request, api_key):
                raise ApiError("invalid or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: "
                               "<key>'", status=401, code="invalid_api_key")
            response = await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the client is gone: nobody to answer
        except Exception as e:
            error = _api_error(e, request)
            if error is None:
                raise
            response = error.response(anthropic=request.path.startswith("/v1/messages"))
        metrics.count_http(route, response.status)
        return response

    return middleware


def _has_key(request: web.Request, api_key: str) -> bool:
    given = [request.headers.get("x-api-key"), request.headers.get("Authorization", "").removeprefix("Bearer ")]
    return any(key is not None and hmac.compare_digest(key.encode(), api_key.encode()) for key in given)


def _api_error(e: Exception, request: web.Request) -> ApiError | None:
    """The error answer for an exception out of a handler (None: not an error, e.g. a redirect)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            return None
        return ApiError(e.reason, status=e.status, code=e.reason.lower().replace(" ", "_"),
                        type="invalid_request_error" if e.status < 500 else "server_error")
    if isinstance(e, EngineDeadError):
        return ApiError(str(e), status=503, type="server_error", code="engine_dead")
    if isinstance(e, EngineError):
        return ApiError(str(e), status=500, type="server_error", code="engine_error")
    logger.exception("unhandled error in %s %s", request.method, request.path)
    return ApiError(f"internal server error: {type(e).__name__}: {e}", status=500, type="server_error",
                    code="internal_error")


async def _health(request: web.Request, state: ServerState) -> web.Response:
    if state.engine.is_healthy:
        return web.json_response({"status": "ok"})
    reason = state.engine.error or "the engine is not running"
    return error_response(str(reason), status=503, type="server_error", code="engine_unavailable")


async def _ready(request: web.Request, state: ServerState) -> web.Response:
    """Readiness, apart from /health's liveness (Kubernetes' two probes): 200 once a background
    warm-up has compiled a lone request's programs; 503 with its progress before (requests are
    taken meanwhile, and wait for the compiles they need)."""
    engine, warming = state.engine, state.engine.warming
    if not engine.is_healthy:
        return await _health(request, state)
    if warming is None or warming.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "warming_up", "programs_compiled": warming.compiled,
                              "programs_total": warming.total}, status=503)


async def _models(request: web.Request, state: ServerState) -> web.Response:
    return web.json_response({"object": "list", "data": [state.model_card()]})
