"""`POST /v1/responses`: OpenAI's Responses API (what the Agents SDK and Codex speak), stateless,
on the chat request path.

A Responses body becomes the chat completions body for the same conversation
(responses_request.py) and runs as that chat request: the same prompt, sampling, constraints and
output parsers, so the same tokens. The reply is a `response` whose `output` holds, in the order
the model wrote them, a `reasoning` item (the reasoning parser's reasoning as `reasoning_text`), a
`message` item (its `output_text`) and a `function_call` item per parsed call (`call_id`, `name`,
`arguments`); `status` is "completed", or "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the length cut it; `usage` counts `input_tokens` (with
`input_tokens_details.cached_tokens`, the prefix cache's hits) and `output_tokens`. Streamed, the
same items come as the response.* events (created, in_progress, output_item.added / done,
content_part.added / done, output_text.delta / done, reasoning_text.delta / done,
function_call_arguments.delta / done, completed or incomplete), each with its `sequence_number`;
an engine failure mid-stream is an `error` event.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterable, Mapping

from ..parsers import ToolCall
from ..parsers.markup import call_id
from .async_engine import EngineError
from .delivery import ChoiceEvent, FoldedChoice, choice_events, fold, send_sse, started
from .errors import web
from .protocol import ChatRequest, warnings_headers
from .replies import cached_tokens
from .responses_request import chat_body
from .state import ServerState

logger = logging.getLogger(__name__)


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ToolCall, reply_id: str, index: int, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id or call_id(reply_id, index), "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def output_items(choice: FoldedChoice, reply_id: str, parsed: bool) -> list[dict[str, Any]]:
    """A whole reply's output: its reasoning, its text, its calls (`parsed`: the request's output
    parsers split them; else all of it is text). Empty parts make no item, as in the stream."""
    if not parsed:
        return [message_item(f"msg_{reply_id}_0", choice.text)] if choice.text else []
    items = []
    if choice.reasoning:
        items.append(reasoning_item(f"rs_{reply_id}_{len(items)}", choice.reasoning))
    if choice.content:
        items.append(message_item(f"msg_{reply_id}_{len(items)}", choice.content))
    return items + [call_item(f"fc_{reply_id}_{len(items) + i}", call, reply_id, i)
                    for i, call in enumerate(choice.tool_calls)]


def response_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseHead:
    """The fields every form of one response shares."""

    def __init__(self, body: Mapping[str, Any], request: ChatRequest, reply_id: str, model: str):
        self.request, self.reply_id = request, reply_id
        self.fields = {"id": f"resp_{reply_id}", "object": "response", "created_at": int(time.time()), "model": model,
                       "instructions": body.get("instructions"), "tools": body.get("tools") or [],
                       "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": True,
                       "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                       "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
                       "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": body.get("reasoning"),
                       "store": False, "error": None}

    def response(self, status: str, output: list[dict[str, Any]], choice: FoldedChoice | None) -> dict[str, Any]:
        incomplete = choice is not None and choice.finish_reason == "length"
        if status == "completed" and incomplete:
            status = "incomplete"
        body = {**self.fields, "status": status, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "usage": None}
        if choice is not None:
            body["usage"] = response_usage(len(self.request.prompt_ids), choice.generated, cached_tokens(choice.metrics))
        return body


class ItemStream:
    """The response.* events of a streamed choice's events, one output item open at a time."""

    def __init__(self, reply_id: str):
        self.reply_id, self.items, self.open, self.text = reply_id, [], None, ""

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.reply_id}_{len(self.items)}"

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, item = self.open, self.items[-1]
        index, item_id, events = len(self.items) - 1, item["id"], []
        if kind == "reasoning":
            item = reasoning_item(item_id, self.text)
            events.append({"type": "response.reasoning_text.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "text": self.text})
        else:
            item = message_item(item_id, self.text)
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "text": self.text, "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "part": part}]
        self.items[-1], self.open, self.text = item, None, ""
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events = self.close()
            item = (reasoning_item(self._item_id("rs"), "") | {"content": []} if kind == "reasoning"
                    else message_item(self._item_id("msg"), "", "in_progress"))
            self.items.append(item)
            self.open, index = kind, len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": index, "item": item})
            if kind == "message":
                events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        self.text += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        delta = {"type": delta_type, "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1,
                 "content_index": 0, "delta": text}
        return events + [delta if kind == "reasoning" else {**delta, "logprobs": []}]

    def push(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        """The item events of one choice event (reasoning, then text, then whole calls)."""
        if event.parsed is None:
            return self._text("message", event.text)
        out = self._text("reasoning", event.parsed.reasoning) + self._text("message", event.parsed.content)
        for index, call in event.parsed.tool_calls:
            out += self.close()
            item_id, output_index = self._item_id("fc"), len(self.items)
            added = call_item(item_id, call, self.reply_id, index, "in_progress")
            done = call_item(item_id, call, self.reply_id, index)
            self.items.append(done)
            out += [{"type": "response.output_item.added", "output_index": output_index, "item": added},
                    {"type": "response.function_call_arguments.delta", "item_id": item_id,
                     "output_index": output_index, "delta": call.arguments},
                    {"type": "response.function_call_arguments.done", "item_id": item_id,
                     "output_index": output_index, "name": call.name, "arguments": call.arguments},
                    {"type": "response.output_item.done", "output_index": output_index, "item": done}]
        return out


async def _whole(events: AsyncIterator[ChoiceEvent], head: ResponseHead, warnings: Iterable[str]) -> web.Response:
    [choice] = fold([event async for event in events], 1)
    output = output_items(choice, head.reply_id, head.request.parsers is not None)
    return web.json_response(head.response("completed", output, choice), headers=warnings_headers(warnings))


async def _streamed(http_request: web.Request, events: AsyncIterator[ChoiceEvent], head: ResponseHead,
                    warnings: Iterable[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", **warnings_headers(warnings)})
    items, choice, sequence = ItemStream(head.reply_id), FoldedChoice(0), iter(range(1 << 62))

    async def send(payload: dict[str, Any]) -> None:
        await send_sse(response, {**payload, "sequence_number": next(sequence)}, event=payload["type"])

    try:
        await response.prepare(http_request)
        await send({"type": "response.created", "response": head.response("in_progress", [], None)})
        await send({"type": "response.in_progress", "response": head.response("in_progress", [], None)})
        async for event in events:
            choice.add(event)
            for payload in items.push(event):
                await send(payload)
        for payload in items.close():
            await send(payload)
        final = head.response("completed", items.items, choice)
        await send({"type": f"response.{final['status']}", "response": final})
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; leaving the choices' context aborts them
    except EngineError as e:  # headers are sent: an error event, as the API does mid-stream
        logger.warning("request %s failed mid-stream: %s", head.reply_id, e)
        with contextlib.suppress(ConnectionError):
            await send({"type": "error", "code": "engine_error", "message": str(e), "param": None})
            await response.write_eof()
    return response


async def responses(http_request: web.Request, state: ServerState) -> web.StreamResponse:
    body = await state.body(http_request)
    chat, warnings = chat_body(body)
    request = ChatRequest.from_body(chat, state.limits, state.tokenizer, state.chat_template, state.parsing)
    reply_id = uuid.uuid4().hex
    head = ResponseHead(body, request, reply_id, state.model_name)
    choices = state.engine.choices(request.prompt_ids, request.sampling, 1, f"resp_{reply_id}")
    async with started(choices, request):
        events = choice_events(choices, request, with_metrics=True)
        async with contextlib.aclosing(events):
            if request.stream:
                return await _streamed(http_request, events, head, [*warnings, *request.warnings])
            return await _whole(events, head, [*warnings, *request.warnings])
