"""`POST /v1/completions`: a prompt (a string, token ids, or a one-element list holding either;
several prompts per request are refused: send one request each) continued, streamed or whole,
with completions' logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and
`echo` (the reply starts with the prompt, and with `logprobs` its prompt logprobs, the first
None; `max_tokens: 0` is allowed with it: one token is generated and left out)."""

from __future__ import annotations

from typing import Any, Callable

from .delivery import ChoiceEvent, FoldedChoice, answer, chunk_fields, whole_fields
from .errors import web
from .protocol import CompletionRequest
from .replies import completion_logprobs
from .state import ServerState


class CompletionReply:
    """Completions' reply fields (delivery.Reply)."""

    whole_object = chunk_object = "text_completion"

    def __init__(self, request: CompletionRequest, token_text: Callable[[int], str]):
        self.request, self.token_text = request, token_text

    def opening(self, index: int) -> None:
        return None

    def chunk_choices(self, event: ChoiceEvent, offset: int) -> tuple[list[dict[str, Any]], int]:
        lp = None
        if self.request.logprobs and event.token_ids and event.logprobs is not None:
            lp = completion_logprobs(event.token_ids, event.logprobs, self.token_text, offset)
            offset += sum(len(self.token_text(t)) for t in event.token_ids)
        if not (event.text or lp or event.prompt or event.finish_reason):
            return [], offset
        return [chunk_fields(event, lp, text=event.text)], offset

    def whole_choice(self, choice: FoldedChoice) -> dict[str, Any]:
        lp = None
        if self.request.logprobs and choice.logprobs is not None:
            lp = completion_logprobs(choice.token_ids, choice.logprobs, self.token_text)
        return whole_fields(choice, lp, text=choice.text)


async def completions(http_request: web.Request, state: ServerState) -> web.StreamResponse:
    body = await state.body(http_request)
    request = CompletionRequest.from_body(body, state.limits, state.tokenizer)
    return await answer(http_request, state.engine, request, CompletionReply(request, state.token_text),
                        state.model_name, "cmpl", request.prompt_text)
