"""The interface of reasoning parsers, and the common case: reasoning that ends at `</think>`.

A parser splits a model's output into its reasoning and the content after it (`split`); on text
still growing (`final=False`) it gives only what later text cannot change, and content None while
the reasoning has not ended. Chat templates of thinking models end the prompt with `<think>`, so
the output starts inside the reasoning; a `<think>` the model writes itself (blanks before it
included) is dropped. An output
that ends before its reasoning does is all reasoning.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping

from ..markup import first_marker, settled


def thinking_off(template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the request turned thinking off (`thinking` / `enable_thinking` false)."""
    return template_kwargs.get("thinking") is False or template_kwargs.get("enable_thinking") is False


def thinking_on(template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the request turned thinking on (`thinking` / `enable_thinking` true)."""
    return template_kwargs.get("thinking") is True or template_kwargs.get("enable_thinking") is True


class ReasoningParser(abc.ABC):
    """A model family's reasoning markup -> (reasoning, content)."""

    name: ClassVar[str]  # as vLLM names it (`--reasoning_parser`)
    # The text after which the answer starts (a constrained answer's grammar starts there).
    answer_marker: ClassVar[str | None] = "</think>"

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that end the reasoning (none: it never ends by a marker)."""
        return ()

    @classmethod
    def thinks(cls, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a request with these chat-template kwargs makes the model reason (on unless
        turned off)."""
        return not thinking_off(template_kwargs)

    @abc.abstractmethod
    def split(self, text: str, final: bool, search_from: int = 0) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`; content None while the reasoning goes on. `search_from`:
        where a marker that ends the reasoning may start at the earliest (a streaming caller that
        found none in the text before knows it)."""

    def tidy(self, content: str, final: bool) -> str:
        """The content after the reasoning as the reply gives it; unless `final`, only what later
        text cannot change. As it is, but for families that leave stray reasoning markup in it."""
        return content


class ThinkParser(ReasoningParser):
    """Reasoning up to `end` (dropped), or up to one of `ends_before` (kept, it starts the content)."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    ends_before: ClassVar[tuple[str, ...]] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.end, *self.ends_before)

    def split(self, text: str, final: bool, search_from: int = 0) -> tuple[str | None, str | None]:
        lead = len(text) - len(text.lstrip())  # blanks before the model's own <think> (DeepSeek-R1 writes a newline)
        if text.startswith(self.start, lead):
            skipped = lead + len(self.start)
            text, search_from = text[skipped:], max(0, search_from - skipped)
        elif not final and self.start.startswith(text[lead:]):
            return "", None  # may still be the model's own <think>
        found = first_marker(text, self.markers, search_from)
        if found is None:
            return settled(text, self.markers, final), None
        at, marker = found
        return text[:at], text[at + len(marker) if marker == self.end else at:]
