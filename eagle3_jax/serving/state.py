"""What every route of one server shares: the engine, the tokenizer, the limits, the chat template
and the parsers of chat outputs."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any, Callable

from ..parsers import OutputParsing
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from .async_engine import AsyncEngine
from .errors import ApiError, web
from .protocol import Limits


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    limits: Limits
    chat_template: ChatTemplate
    parsing: OutputParsing = OutputParsing()
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        # A token's text in logprobs replies (decoded alone, special tokens shown, as vLLM does).
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token: self.tokenizer.decode([token], skip_special_tokens=False))

    async def body(self, http_request: web.Request) -> dict[str, Any]:
        """A generation request's JSON object, for this server's model; 400 / 404 otherwise."""
        try:
            body = await http_request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise ApiError(f"the request body must be a JSON object; got {type(body).__name__}", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")
        return body

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "eagle3-jax",
                "max_model_len": self.limits.max_seq_len}
