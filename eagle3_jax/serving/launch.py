"""Starting the HTTP server around a running engine (what `scripts/serve.py` does after the model
loads): the output parsers in effect for the model, the ids requests stop at, the start-up's
long-lived objects kept out of later garbage collections, and the app run until stopped."""

from __future__ import annotations

import dataclasses
import gc
from typing import Sequence

from ..parsers.defaults import default_reasoning_parser, default_tool_call_parser
from ..text.chat_template import ChatTemplate
from .async_engine import AsyncEngine
from .errors import web

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


def stop_ids(model_eos: Sequence[int], tokenizer_eos: Sequence[int]) -> tuple[int, ...]:
    """EOS ids from the model config and the tokenizer folder, without repeats, in order."""
    return tuple(dict.fromkeys([*model_eos, *tokenizer_eos]))


def settle_heap() -> None:
    """Collect once and freeze what survives. The model, the compiled programs and their tracing
    leave many long-lived objects: kept out of later collections, the first full collection
    (during the first burst of requests) does not walk them all."""
    gc.collect()
    gc.freeze()


def serve_until_stopped(application: web.Application, engine: AsyncEngine, host: str, port: int) -> None:
    """Run `application` on host:port until Ctrl-C (or SIGTERM); the engine closes with the app and
    is shut down however the run ends. A client that disconnects cancels its handler
    (handler_cancellation), which aborts its request."""

    async def close_engine(_app: web.Application) -> None:
        await engine.close()

    application.on_cleanup.append(close_engine)
    try:
        web.run_app(application, host=host, port=port, handler_cancellation=True, print=None)
    finally:
        engine.shutdown()
