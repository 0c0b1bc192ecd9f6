"""Which parsers a model's outputs need, from its config's `model_type` and its chat template.

As vLLM's recipes for each family set them: Kimi-K2 / K2.5 `kimi_k2` (both); MiniMax-M2
`minimax_m2` with `minimax_m2_append_think` (MiniMax's advice: agents send the content back, and
the model needs its reasoning in the history); DeepSeek-V3 `deepseek_v3`, or `deepseek_v31` when
the template writes the V3.1 markup (arguments right after the name, no fenced block); Llama
`llama3_json` when its template takes tools. A reasoning parser only where the template knows
`<think>` (Kimi-K2-Instruct and DeepSeek-V3-0324 never reason); DeepSeek's `deepseek_v3` when
thinking is a template switch (V3.1+), `deepseek_r1` when the template always opens it.
"""

from __future__ import annotations

import dataclasses

from ..text.chat_template import ChatTemplate

_KIMI = ("kimi_k2", "kimi_k25")
_DEEPSEEK = ("deepseek_v3", "deepseek_v32")


def default_tool_call_parser(model_type: str, template: str | None) -> str | None:
    template = template or ""
    if model_type in _KIMI:
        return "kimi_k2"
    if model_type == "minimax_m2":
        return "minimax_m2"
    if model_type in _DEEPSEEK:
        return "deepseek_v3" if "```json" in template or "<｜tool▁sep｜>" not in template else "deepseek_v31"
    if model_type == "llama" and "tools" in template:
        return "llama3_json"
    return None


def default_reasoning_parser(model_type: str, template: str | None) -> str | None:
    template = template or ""
    if "<think>" not in template and "</think>" not in template:
        return None
    if model_type in _KIMI:
        return "kimi_k2"
    if model_type == "minimax_m2":
        return "minimax_m2_append_think"
    if model_type in _DEEPSEEK:
        return "deepseek_v3" if "thinking" in template else "deepseek_r1"
    return None


AUTO, NONE = "auto", "none"  # parser names that mean "the model family's" and "off"


@dataclasses.dataclass(frozen=True)
class OutputParsers:
    """The tool-call and reasoning parsers chat replies go through (vLLM's names; None: off), and
    which of them were chosen for the model's family ("tool_call_parser", "reasoning_parser")
    rather than asked for by name."""

    tool_call_parser: str | None
    reasoning_parser: str | None
    auto: tuple[str, ...] = ()


def template_text(template: ChatTemplate) -> str:
    """Every source of a chat template (the default one and the named ones), one after another:
    what the family's default parsers are read from."""
    return "\n".join(filter(None, [template.source, *dict(template.named).values()]))


def output_parsers(model_type: str, template: ChatTemplate, tool_call_parser: str = AUTO,
                   reasoning_parser: str = AUTO) -> OutputParsers:
    """The parsers in effect: a name as given ("none": off), "auto" as the family of `model_type`
    and its chat template call for (off where none fits)."""
    source = template_text(template)
    chosen, auto = {}, []
    for kind, value, default in (("tool_call_parser", tool_call_parser, default_tool_call_parser),
                                 ("reasoning_parser", reasoning_parser, default_reasoning_parser)):
        if value == AUTO:
            value = default(model_type, source) or NONE
            auto.append(kind)
        chosen[kind] = None if value == NONE else value
    return OutputParsers(chosen["tool_call_parser"], chosen["reasoning_parser"], tuple(auto))
