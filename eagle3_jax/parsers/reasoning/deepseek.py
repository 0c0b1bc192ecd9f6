"""DeepSeek reasoning: R1 always thinks (`deepseek_r1`); V3.1 / V3.2 think when the request sets
the template kwarg `thinking` (or `enable_thinking`) true (`deepseek_v3`), as vLLM reads them."""

from __future__ import annotations

from typing import Any, Mapping

from .base import ThinkParser, thinking_on


class DeepSeekR1(ThinkParser):
    name = "deepseek_r1"


class DeepSeekV3(ThinkParser):
    name = "deepseek_v3"

    @classmethod
    def thinks(cls, template_kwargs: Mapping[str, Any]) -> bool:
        return thinking_on(template_kwargs)
