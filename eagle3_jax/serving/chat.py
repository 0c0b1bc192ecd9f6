"""`POST /v1/chat/completions`: messages rendered with the model's chat template (with `tools`,
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`), answered streamed
or whole, with chat's logprobs (`content` items with `token`, `logprobs`, `bytes`,
`top_logprobs`).

With the server's output parsers, a reply's message carries `reasoning_content` (and `reasoning`,
the name vLLM now uses) and OpenAI `tool_calls` (arguments as a JSON string; finish_reason
"tool_calls"). Streamed, reasoning and content come as delta fields as they settle, and each call
as two chunks: its `index`, `id`, `type` and `function.name` once, then its arguments.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable

from ..parsers import message_content
from .delivery import ChoiceEvent, FoldedChoice, answer, chunk_fields, whole_fields
from .errors import web
from .protocol import ChatRequest
from .replies import chat_logprobs
from .state import ServerState


class ChatReply:
    """Chat's reply fields (delivery.Reply)."""

    whole_object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, request: ChatRequest, token_text: Callable[[int], str]):
        self.request, self.token_text = request, token_text
        self.id_seed = uuid.uuid4().hex  # tool call ids: the same in a reply's chunks, new in every reply

    def opening(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def _logprobs(self, token_ids, entries) -> dict[str, Any] | None:
        if not self.request.logprobs or not token_ids or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.token_text)

    def _deltas(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        parsed = event.parsed
        if parsed is None:
            return [{"content": event.text}] if event.text else []
        deltas = []
        if parsed.reasoning:
            deltas.append({"reasoning_content": parsed.reasoning, "reasoning": parsed.reasoning})
        if parsed.content:
            deltas.append({"content": parsed.content})
        for index, call in parsed.tool_calls:
            whole = call.openai(index, f"{self.id_seed}-{event.index}")
            deltas.append({"tool_calls": [{"index": index, **whole,
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas

    def chunk_choices(self, event: ChoiceEvent, offset: int) -> tuple[list[dict[str, Any]], int]:
        lp = self._logprobs(event.token_ids, event.logprobs)
        deltas = self._deltas(event)
        if not deltas and (lp or event.finish_reason):
            deltas = [{}]
        unfinished = dataclasses.replace(event, finish_reason=None)
        return [chunk_fields(event if k == len(deltas) - 1 else unfinished, lp if k == 0 else None, delta=delta)
                for k, delta in enumerate(deltas)], offset

    def message(self, choice: FoldedChoice) -> dict[str, Any]:
        """A whole reply's message: the text, or with output parsers its parts."""
        parsers = self.request.parsers
        if parsers is None:
            return {"role": "assistant", "content": choice.text}
        message = {"role": "assistant", "content": message_content(choice.content, choice.reasoning, choice.tool_calls)}
        if parsers.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = choice.reasoning or None
        if choice.tool_calls:
            message["tool_calls"] = [call.openai(i, f"{self.id_seed}-{choice.index}")
                                     for i, call in enumerate(choice.tool_calls)]
        return message

    def whole_choice(self, choice: FoldedChoice) -> dict[str, Any]:
        lp = None
        if self.request.logprobs and choice.logprobs is not None:
            lp = chat_logprobs(choice.token_ids, choice.logprobs, self.token_text)
        return whole_fields(choice, lp, message=self.message(choice))


async def chat_completions(http_request: web.Request, state: ServerState) -> web.StreamResponse:
    body = await state.body(http_request)
    request = ChatRequest.from_body(body, state.limits, state.tokenizer, state.chat_template, state.parsing)
    return await answer(http_request, state.engine, request, ChatReply(request, state.token_text), state.model_name,
                        "chatcmpl")
