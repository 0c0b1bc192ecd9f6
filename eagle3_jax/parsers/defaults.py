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
