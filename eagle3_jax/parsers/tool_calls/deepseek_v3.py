"""DeepSeek-V3 / R1 tool calls (vLLM's `deepseek_v3`), arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..markup import ToolCall, json_object_text, known
from .base import Schemas, SectionParser, Terminal, json_rule, literal

_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>\s*(?P<type>[^<]*?)\s*<｜tool▁sep｜>(?P<name>[^\n<]+?)\s*"
                   r"```(?:json)?\s*(?P<args>.*?)\s*```\s*<｜tool▁call▁end｜>\s*", re.S)


class DeepSeekV3(SectionParser):
    name = "deepseek_v3"
    arguments_as = "text"  # its template concatenates the arguments as a string
    begins = ("<｜tool▁calls▁begin｜>",)
    ends = ("<｜tool▁calls▁end｜>",)
    call = _CALL

    def call_of(self, match: re.Match[str], schemas: Schemas) -> ToolCall | None:
        name, arguments = match["name"].strip(), json_object_text(match["args"])
        if match["type"] != "function" or arguments is None or not known(name, schemas):
            return None
        return ToolCall(name, arguments)

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        return [f"call_{index}: {terminal('<｜tool▁call▁begin｜>')} {literal('function')} {terminal('<｜tool▁sep｜>')} "
                f"{literal(name + chr(10) + '```json' + chr(10))} args_{index} {literal(chr(10) + '```')} "
                f"{terminal('<｜tool▁call▁end｜>')}",
                f"args_{index}: {json_rule(parameters)}"]
