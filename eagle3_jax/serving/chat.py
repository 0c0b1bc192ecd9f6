"""`POST /v1/chat/completions`: messages rendered with the model's chat template (with `tools`,
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`), answered streamed
or whole, with chat's logprobs (`content` items with `token`, `logprob`, `bytes`,
`top_logprobs`)."""

from __future__ import annotations

from typing import Any, Callable

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

    def opening(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def _logprobs(self, token_ids, entries) -> dict[str, Any] | None:
        if not self.request.logprobs or not token_ids or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.token_text)

    def chunk_choice(self, event: ChoiceEvent, offset: int) -> tuple[dict[str, Any] | None, int]:
        lp = self._logprobs(event.token_ids, event.logprobs)
        if not (event.text or lp or event.finish_reason):
            return None, offset
        return chunk_fields(event, lp, delta={"content": event.text} if event.text else {}), offset

    def whole_choice(self, choice: FoldedChoice) -> dict[str, Any]:
        lp = None
        if self.request.logprobs and choice.logprobs is not None:
            lp = chat_logprobs(choice.token_ids, choice.logprobs, self.token_text)
        return whole_fields(choice, lp, message={"role": "assistant", "content": choice.text})


async def chat_completions(http_request: web.Request, state: ServerState) -> web.StreamResponse:
    body = await state.body(http_request)
    request = ChatRequest.from_body(body, state.limits, state.tokenizer, state.chat_template)
    return await answer(http_request, state.engine, request, ChatReply(request, state.token_text), state.model_name,
                        "chatcmpl")
