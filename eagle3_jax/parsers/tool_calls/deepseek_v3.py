"""DeepSeek-V3 / R1 tool calls (vLLM's `deepseek_v3`), arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..arguments import arguments_text
from ..markup import ToolCall, known
from .base import Schemas, SectionParser, Terminal, json_rule, literal

_SEP = "<｜tool▁sep｜>"
# the name, then the arguments, fenced (```json ... ```) as the format writes them, or bare
_NAMED = re.compile(r"\s*(?P<name>[^\s`]+)\s*(?:```[a-zA-Z]*\s*(?P<fenced>.*?)\s*```|(?P<bare>.*?))\s*", re.S)


class DeepSeekV3(SectionParser):
    name = "deepseek_v3"
    arguments_as = "text"  # its template concatenates the arguments as a string
    begins = ("<｜tool▁calls▁begin｜>",)
    ends = ("<｜tool▁calls▁end｜>",)
    call_begin, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    bare_calls = True  # a call the model wrote without its section is still a call

    def call_of(self, body: str, schemas: Schemas) -> ToolCall | None:
        kind, sep, rest = body.partition(_SEP)
        named = _NAMED.fullmatch(rest)
        if not sep or kind.strip() not in ("function", "") or named is None:
            return None
        return named_call(named["name"], named["fenced"] if named["fenced"] is not None else named["bare"], schemas)

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        return [f"call_{index}: {terminal('<｜tool▁call▁begin｜>')} {literal('function')} {terminal('<｜tool▁sep｜>')} "
                f"{literal(name + chr(10) + '```json' + chr(10))} args_{index} {literal(chr(10) + '```')} "
                f"{terminal('<｜tool▁call▁end｜>')}",
                f"args_{index}: {json_rule(parameters)}"]


def named_call(name: str, arguments: str, schemas: Schemas) -> ToolCall | None:
    """The call of `name` with `arguments` (JSON object text as `arguments_text` reads it)."""
    arguments = arguments_text(arguments)
    return None if arguments is None or not known(name, schemas) else ToolCall(name, arguments)
