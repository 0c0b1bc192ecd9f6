"""DeepSeek-V3.1 tool calls (vLLM's `deepseek_v31`), arguments right after the name:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..markup import ToolCall, json_object_text, known
from .base import Schemas, Terminal, json_rule, literal
from .deepseek_v3 import DeepSeekV3

_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<name>[^<]+?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>\s*", re.S)


class DeepSeekV31(DeepSeekV3):
    """V3's section markers and history form; each call's markup differs."""

    name = "deepseek_v31"
    call = _CALL

    def call_of(self, match: re.Match[str], schemas: Schemas) -> ToolCall | None:
        name, arguments = match["name"].strip(), json_object_text(match["args"])
        if arguments is None or not known(name, schemas):
            return None
        return ToolCall(name, arguments)

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        return [f"call_{index}: {terminal('<｜tool▁call▁begin｜>')} {literal(name)} {terminal('<｜tool▁sep｜>')} "
                f"args_{index} {terminal('<｜tool▁call▁end｜>')}",
                f"args_{index}: {json_rule(parameters)}"]
