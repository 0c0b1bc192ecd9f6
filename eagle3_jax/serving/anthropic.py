"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API (what
Claude Code speaks) on the chat request path.

A Messages body becomes the chat completions body for the same conversation
(anthropic_request.py) and runs as that chat request: the same prompt, sampling, constraints
(`tool_choice` any / tool, `output_config.format`) and output parsers, so the same tokens. The
reply is a `message`: `content` blocks in the order the model wrote them (`thinking` with the
reasoning parser's reasoning, `text`, `tool_use` with each parsed call's `input`), `stop_reason`
end_turn / max_tokens / stop_sequence (with `stop_sequence`) / tool_use, and `usage` with
`input_tokens` (the prompt less what the prefix cache held), `cache_read_input_tokens` (what it
held) and `output_tokens`. Streamed, the same blocks come as Anthropic's events: message_start,
ping, content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop per block, message_delta (stop_reason, usage) and message_stop; an engine
failure mid-stream is an `error` event. Errors are Anthropic's error objects (app.py picks the
shape by route). `count_tokens` answers `{"input_tokens": n}` for the prompt the same body
renders.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from typing import Any, AsyncIterator, Iterable, Mapping

from ..parsers import ToolCall
from .anthropic_request import chat_body
from .async_engine import EngineError
from .delivery import ChoiceEvent, FoldedChoice, choice_events, fold, send_sse, started
from .errors import web
from .protocol import ChatRequest, chat_prompt, warnings_headers
from .replies import cached_tokens
from .state import ServerState

logger = logging.getLogger(__name__)

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_fields(finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
    """Anthropic's `stop_reason` and `stop_sequence` for a choice's finish."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": _STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A parsed call's arguments as the `input` object (the parsers give JSON objects)."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call: ToolCall, reply_id: str, index: int) -> str:
    """The call's own id where its markup has one (Kimi's `functions.NAME:IDX`, which its template
    shows again in the next turn), else one made from the reply's."""
    return call.id or f"toolu_{reply_id[4:]}{index:02d}"


def message_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def content_blocks(choice: FoldedChoice, reply_id: str, parsed: bool) -> list[dict[str, Any]]:
    """A whole reply's content: its thinking, its text, its calls (`parsed`: the request's output
    parsers split them; else all of it is text). Empty parts make no block, as in the stream."""
    if not parsed:
        return [{"type": "text", "text": choice.text}] if choice.text else []
    blocks: list[dict[str, Any]] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content:
        blocks.append({"type": "text", "text": choice.content})
    blocks += [{"type": "tool_use", "id": tool_use_id(call, reply_id, i), "name": call.name, "input": tool_input(call)}
               for i, call in enumerate(choice.tool_calls)]
    return blocks


class BlockStream:
    """Anthropic's content-block events for a streamed choice's events, one block open at a time."""

    def __init__(self, reply_id: str):
        self.reply_id, self.index, self.open = reply_id, -1, None

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index, self.open = self.index + 1, kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self.open == kind else self._start(
            kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def push(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        """The block events of one choice event (reasoning, then content, then whole calls)."""
        if event.parsed is None:
            return self._text("text", event.text)
        out = self._text("thinking", event.parsed.reasoning) + self._text("text", event.parsed.content)
        for index, call in event.parsed.tool_calls:
            out += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call, self.reply_id, index),
                                            "name": call.name, "input": {}})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(tool_input(call))}})
            out += self.close()
        return out


def _message_head(reply_id: str, model: str) -> dict[str, Any]:
    return {"id": reply_id, "type": "message", "role": "assistant", "model": model}


async def _whole(events: AsyncIterator[ChoiceEvent], request: ChatRequest, reply_id: str, model: str,
                 warnings: Iterable[str]) -> web.Response:
    [choice] = fold([event async for event in events], 1)
    body = {**_message_head(reply_id, model), "content": content_blocks(choice, reply_id, request.parsers is not None),
            **stop_fields(choice.finish_reason, choice.stop_reason),
            "usage": message_usage(len(request.prompt_ids), choice.generated, cached_tokens(choice.metrics))}
    return web.json_response(body, headers=warnings_headers(warnings))


async def _send(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    await send_sse(response, payload, event=payload["type"])


async def _streamed(http_request: web.Request, events: AsyncIterator[ChoiceEvent], request: ChatRequest,
                    reply_id: str, model: str, warnings: Iterable[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", **warnings_headers(warnings)})
    prompt_tokens, blocks, choice = len(request.prompt_ids), BlockStream(reply_id), FoldedChoice(0)
    try:
        await response.prepare(http_request)
        await _send(response, {"type": "message_start", "message": {
            **_message_head(reply_id, model), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": message_usage(prompt_tokens, 0, 0)}})
        await _send(response, {"type": "ping"})
        async for event in events:
            choice.add(event)
            for payload in blocks.push(event):
                await _send(response, payload)
        for payload in blocks.close():
            await _send(response, payload)
        await _send(response, {"type": "message_delta", "delta": stop_fields(choice.finish_reason, choice.stop_reason),
                               "usage": message_usage(prompt_tokens, choice.generated, cached_tokens(choice.metrics))})
        await _send(response, {"type": "message_stop"})
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; leaving the choices' context aborts them
    except EngineError as e:  # headers are sent: an error event, as Anthropic's API does mid-stream
        logger.warning("request %s failed mid-stream: %s", reply_id, e)
        with contextlib.suppress(ConnectionError):
            await _send(response, {"type": "error", "error": {"type": "api_error", "message": str(e)}})
            await response.write_eof()
    return response


def _chat_request(body: Mapping[str, Any], state: ServerState) -> tuple[ChatRequest, list[str]]:
    chat, warnings = chat_body(body)
    request = ChatRequest.from_body(chat, state.limits, state.tokenizer, state.chat_template, state.parsing)
    return request, [*warnings, *request.warnings]


async def messages(http_request: web.Request, state: ServerState) -> web.StreamResponse:
    body = await state.body(http_request)
    request, warnings = _chat_request(body, state)
    reply_id = f"msg_{uuid.uuid4().hex}"
    # the request's metrics (prefix-cache hits) are read at its finish, speculating or not
    choices = state.engine.choices(request.prompt_ids, request.sampling, 1, reply_id)
    async with started(choices, request):
        events = choice_events(choices, request, with_metrics=True)
        async with contextlib.aclosing(events):
            if request.stream:
                return await _streamed(http_request, events, request, reply_id, state.model_name, warnings)
            return await _whole(events, request, reply_id, state.model_name, warnings)


async def count_tokens(http_request: web.Request, state: ServerState) -> web.Response:
    """The prompt's tokens, counted also when it is longer than the server takes (the client decides)."""
    body = await state.body(http_request)
    chat, _ = chat_body({**body, "max_tokens": 1})
    *_, prompt_ids = chat_prompt(chat, state.tokenizer, state.chat_template, state.parsing)
    return web.json_response({"input_tokens": len(prompt_ids)})
