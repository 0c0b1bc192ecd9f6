"""DeepSeek-V3.1 tool calls (vLLM's `deepseek_v31`), arguments right after the name:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from typing import Any, Mapping

from ..markup import ToolCall
from .base import Schemas, Terminal, json_rule, literal
from .deepseek_v3 import DeepSeekV3, named_call


class DeepSeekV31(DeepSeekV3):
    """V3's section and call markers and history form; the call between them differs."""

    name = "deepseek_v31"

    def call_of(self, body: str, schemas: Schemas) -> ToolCall | None:
        name, sep, arguments = body.partition("<｜tool▁sep｜>")
        return named_call(name.strip(), arguments, schemas) if sep and name.strip() else None

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        return [f"call_{index}: {terminal('<｜tool▁call▁begin｜>')} {literal(name)} {terminal('<｜tool▁sep｜>')} "
                f"args_{index} {terminal('<｜tool▁call▁end｜>')}",
                f"args_{index}: {json_rule(parameters)}"]
