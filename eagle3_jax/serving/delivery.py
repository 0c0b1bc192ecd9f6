"""Per-choice delivery: a request's engine deltas become reply events, and events become the reply.

`choice_events` turns the deltas of a request's choices into `ChoiceEvent`s (what one delta adds
to one choice: text, tokens and their logprobs, and on a choice's last event why it ended). A
chat request with output parsers has each choice's text parsed as it streams (parsers/output.py):
its events also carry what the delta adds to the reasoning, the content and the tool calls, and a
choice that made calls ends with finish_reason "tool_calls" (when it stopped, not when it was
cut). A streamed reply sends the Server-Sent Event chunks of each event that adds anything; a
whole reply is the fold of the same events (`fold`), so streamed and whole replies cannot differ,
and whatever turns text into reply fields (the routes' `Reply`) is written once, for both.

Streaming answers are `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`, started once every choice's
first delta is out (so the engine's validation errors still get a 4xx status); with
`stream_options.include_usage` a last chunk with empty `choices` carries `usage`. A client that
disconnects mid-stream has its choices aborted; an engine error mid-stream is reported in-band,
as OpenAI does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterable, Mapping, Protocol, Sequence

from ..parsers import OutputDelta, StreamingParser, ToolCall
from ..sampling.logprobs import Logprob
from ..structured import ConstraintError
from .async_engine import AsyncEngine, CapacityError, EngineError
from .choices import Choices
from .errors import ApiError, web
from .protocol import GenerationRequest
from .replies import finish_reason, merge_spec_metrics, usage

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ChoiceEvent:
    """What one delta adds to one choice of a reply."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob | None, ...] | None = None  # of token_ids, when the request asks for them
    prompt: bool = False  # echo: the prompt repeated, not generated tokens
    finish_reason: str | None = None  # on a choice's last event
    stop_reason: int | str | None = None
    metrics: Mapping[str, Any] | None = None  # the finished request's, with a speculating engine
    parsed: OutputDelta | None = None  # with output parsers: what `text` adds to reasoning, content, calls


@dataclasses.dataclass
class FoldedChoice:
    """One choice of a whole reply: its events folded."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob | None] | None = None
    generated: int = 0  # tokens generated (usage), the echoed prompt not counted
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: Mapping[str, Any] | None = None
    content: str = ""  # with output parsers: the text less reasoning and call markup
    reasoning: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def add(self, event: ChoiceEvent) -> None:
        self.text += event.text
        if event.parsed is not None:
            self.content += event.parsed.content
            self.reasoning += event.parsed.reasoning
            self.tool_calls += [call for _, call in event.parsed.tool_calls]
        self.token_ids += event.token_ids
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(event.logprobs)
        self.generated += 0 if event.prompt else len(event.token_ids)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.metrics = event.finish_reason, event.stop_reason, event.metrics


def fold(events: Iterable[ChoiceEvent], n: int) -> list[FoldedChoice]:
    """The whole reply's n choices from their events."""
    folded = [FoldedChoice(i) for i in range(n)]
    for event in events:
        folded[event.index].add(event)
    return folded


async def choice_events(choices: Choices, request: GenerationRequest, prompt_text: str = "",
                        with_metrics: bool = False) -> AsyncIterator[ChoiceEvent]:
    """The events of a started request's choices, interleaved as their deltas come; with echo, each
    choice opens with the prompt (`prompt_text`, and its logprobs when asked for). A choice's last
    event carries its request's metrics with a speculating engine (usage's figures), or always
    `with_metrics`."""
    if request.echo:
        for i, first in enumerate(choices.firsts):
            lps = tuple(first.prompt_logprobs) if request.logprobs and first.prompt_logprobs is not None else None
            yield ChoiceEvent(i, prompt_text, tuple(choices.prompt_ids), lps, prompt=True)
    speculates = choices.engine.speculates or with_metrics
    streams = [StreamingParser(request.parsers) for _ in range(request.n)] if request.parsers is not None else None
    async for i, delta in choices:
        if request.echo_only:  # the one token generated for a prompt scored alone is left out
            yield ChoiceEvent(i, finish_reason="length" if delta.finished else None)
            continue
        lps = None if not request.logprobs or delta.logprobs is None else tuple(delta.logprobs)
        out, text = delta.output, delta.text or ""
        reason = finish_reason(delta.finish_reason) if delta.finished else None
        parsed = None
        if streams is not None:
            parsed = streams[i].push(text, final=delta.finished)
            if reason == "stop" and streams[i].sent.tool_calls:
                reason = "tool_calls"
        yield ChoiceEvent(i, text, tuple(delta.token_ids), lps, finish_reason=reason,
                          stop_reason=out.stop_reason if out is not None else None,
                          metrics=out.metrics if out is not None and speculates else None, parsed=parsed)


def reply_usage(request: GenerationRequest, choices: Sequence[FoldedChoice]) -> dict[str, Any]:
    """Usage as vLLM counts n choices: the prompt once, every choice's tokens; with speculation the
    choices' draft figures merged."""
    metrics = [c.metrics for c in choices]
    generated = sum(c.generated for c in choices)
    if not metrics or None in metrics:
        return usage(len(request.prompt_ids), generated)
    return usage(len(request.prompt_ids), generated, metrics[0] if len(metrics) == 1 else merge_spec_metrics(metrics))


def chunk_fields(event: ChoiceEvent, logprobs: dict[str, Any] | None, **body: Any) -> dict[str, Any]:
    """A streamed chunk's choice: its index, the route's `body`, logprobs, and on a choice's last
    event why it ended."""
    choice = {"index": event.index, **body, "logprobs": logprobs, "finish_reason": event.finish_reason}
    if event.finish_reason is not None:
        choice["stop_reason"] = event.stop_reason
    return choice


def whole_fields(choice: FoldedChoice, logprobs: dict[str, Any] | None, **body: Any) -> dict[str, Any]:
    """A whole reply's choice: its index, the route's `body`, logprobs and why it ended."""
    return {"index": choice.index, **body, "logprobs": logprobs, "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason}


class Reply(Protocol):
    """How a route renders events into its reply's fields (completions and chat differ only here)."""

    whole_object: str  # "text_completion" | "chat.completion"
    chunk_object: str  # "text_completion" | "chat.completion.chunk"

    def opening(self, index: int) -> dict[str, Any] | None:
        """A choice's first streamed chunk choice before any event (chat: the assistant role), or None."""

    def chunk_choices(self, event: ChoiceEvent, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The streamed chunks' choices for an event (none when it adds nothing to send), and the
        text offset after it (completions' logprobs count offsets across chunks)."""

    def whole_choice(self, choice: FoldedChoice) -> dict[str, Any]:
        """A whole reply's choice."""


@contextlib.asynccontextmanager
async def started(choices: Choices, request: GenerationRequest) -> AsyncIterator[Choices]:
    """`choices` with every first delta out; the engine's refusals become 400s naming the field."""
    async with choices:
        try:
            await choices.start()
        except CapacityError as e:
            raise ApiError(str(e), param="max_tokens", code="request_too_large") from e
        except ConstraintError as e:  # the grammar did not compile
            raise ApiError(str(e), param=request.constraint_field, code="invalid_value") from e
        except ValueError as e:  # add_request's validation: bad token ids, no room in max_seq_len
            raise ApiError(str(e), param="prompt" if request.kind == "completion" else "messages",
                           code="invalid_value") from e
        yield choices


def _head(reply_id: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {"id": reply_id, "object": obj, "created": created, "model": model}


async def whole_reply(events: AsyncIterator[ChoiceEvent], request: GenerationRequest, reply: Reply,
                      reply_id: str, model: str) -> web.Response:
    """The reply as one JSON body: the fold of the events."""
    choices = fold([event async for event in events], request.n)
    body = {**_head(reply_id, reply.whole_object, int(time.time()), model),
            "choices": [reply.whole_choice(c) for c in choices], "usage": reply_usage(request, choices)}
    if request.warnings:
        body["warnings"] = list(request.warnings)
    return web.json_response(body, headers=request.headers())


async def stream_reply(http_request: web.Request, events: AsyncIterator[ChoiceEvent], request: GenerationRequest,
                       reply: Reply, reply_id: str, model: str) -> web.StreamResponse:
    """The reply as Server-Sent Events, one chunk per event that adds anything."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", **request.headers()})
    head = _head(reply_id, reply.chunk_object, int(time.time()), model)
    extra = {"usage": None} if request.include_usage else {}
    folded = [FoldedChoice(i) for i in range(request.n)]  # for the usage chunk
    offsets = [0] * request.n
    try:
        await response.prepare(http_request)
        for i in range(request.n):
            opening = reply.opening(i)
            if opening is not None:
                await send_event(response, {**head, "choices": [opening], **extra})
        async for event in events:
            folded[event.index].add(event)
            sent, offsets[event.index] = reply.chunk_choices(event, offsets[event.index])
            for choice in sent:
                await send_event(response, {**head, "choices": [choice], **extra})
        if request.include_usage:
            await send_event(response, {**head, "choices": [], "usage": reply_usage(request, folded)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; leaving the choices' context aborts them
    except EngineError as e:  # headers are sent: report in-band, as OpenAI does mid-stream
        logger.warning("request %s failed mid-stream: %s", reply_id, e)
        with contextlib.suppress(ConnectionError):
            await send_event(response, {"error": {"message": str(e), "type": "server_error", "param": None,
                                                  "code": "engine_error"}})
            await response.write_eof()
    return response


async def send_event(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    """One Server-Sent Event."""
    await send_sse(response, payload)


async def send_sse(response: web.StreamResponse, payload: Mapping[str, Any], event: str | None = None) -> None:
    """One Server-Sent Event, named `event` where the API names its events (Anthropic's, Responses')."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    await response.write(f"{head}data: {data}\n\n".encode("utf-8"))



async def answer(http_request: web.Request, engine: AsyncEngine, request: GenerationRequest, reply: Reply,
                 model: str, id_prefix: str, prompt_text: str = "") -> web.StreamResponse:
    """Run a request's choices on the engine and answer, streamed or whole."""
    reply_id = f"{id_prefix}-{uuid.uuid4().hex}"
    choices = engine.choices(request.prompt_ids, request.sampling, request.n, reply_id)
    async with started(choices, request):
        events = choice_events(choices, request, prompt_text)
        async with contextlib.aclosing(events):
            if request.stream:
                return await stream_reply(http_request, events, request, reply, reply_id, model)
            return await whole_reply(events, request, reply, reply_id, model)
