"""MiniMax-M2 / M2.5 reasoning: the model always thinks (its prompt ends with `<think>`).

`minimax_m2` splits the reasoning off at `</think>` (a second `</think>` in the answer is dropped). `minimax_m2_append_think` (MiniMax's advice
for agents) keeps it in the content, `<think>` put back in front, so a client that sends the
content back as history gives the model its own reasoning, which it needs to keep its quality.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..markup import settled
from .base import ReasoningParser, ThinkParser


class MiniMaxM2(ThinkParser):
    name = "minimax_m2"

    def tidy(self, content: str, final: bool) -> str:
        """The content with the `</think>` the model at times writes again after its reasoning
        dropped (a reader sees no markup in an answer)."""
        return settled(content, (self.end,), final).replace(self.end, "")

    @classmethod
    def thinks(cls, template_kwargs: Mapping[str, Any]) -> bool:
        return True  # there is no switch: the template always opens the reasoning


class MiniMaxM2AppendThink(ReasoningParser):
    name = "minimax_m2_append_think"

    @classmethod
    def thinks(cls, template_kwargs: Mapping[str, Any]) -> bool:
        return True

    def split(self, text: str, final: bool, search_from: int = 0) -> tuple[str | None, str | None]:
        return None, ThinkParser.start + text
