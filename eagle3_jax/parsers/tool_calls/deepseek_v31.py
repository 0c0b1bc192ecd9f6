"""DeepSeek-V3.1 tool calls (vLLM's `deepseek_v31`), arguments right after the name:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re

from ..markup import ToolCall, json_object_text, known
from .base import Schemas, SectionParser, sequence

_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<name>[^<]+?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>\s*", re.S)


class DeepSeekV31(SectionParser):
    name = "deepseek_v31"
    arguments_as = "text"  # its template concatenates the arguments as a string
    begins = ("<｜tool▁calls▁begin｜>",)
    ends = ("<｜tool▁calls▁end｜>",)

    def calls_in(self, inner: str, schemas: Schemas) -> list[ToolCall] | None:
        matches = sequence(_CALL, inner)
        if matches is None:
            return None
        calls = []
        for m in matches:
            name, arguments = m["name"].strip(), json_object_text(m["args"])
            if arguments is None or not known(name, schemas):
                return None
            calls.append(ToolCall(name, arguments))
        return calls
