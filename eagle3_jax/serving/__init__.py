"""Serving: an asyncio front end for the continuous-batching scheduler and an OpenAI-compatible
HTTP API over it (`scripts/serve.py` runs both).

    engine = AsyncEngine(Scheduler(target, draft, spec), tokenizer=tokenizer).start()
    app = make_app(engine, "my-model")                 # aiohttp web.Application

The package, by concept: `async_engine` (the engine thread and the asyncio bridge) and `choices`
(n choices of one prompt) are the engine's face; `errors`, `fields`, `messages` (chat messages,
tools, tool_choice), `constraints` (structured output fields) and `protocol` turn a body into a
typed request; `delivery` turns a request's
deltas into reply events, parsed into reasoning, content and tool calls (`eagle3_jax.parsers`),
streamed or folded whole (`replies` renders logprobs and usage); `completions` and `chat` are the
routes, and `anthropic` and `responses` (with `anthropic_request` and `responses_request`, their
bodies as chat bodies, and `chat_mapping`, what those two share) Anthropic's Messages API and OpenAI's Responses API on the chat route's path; `app` ties them together with health, models and `metrics`; `launch` starts it around a
running engine (output parsers, stop ids, the run until stopped). The HTTP parts need the `serve`
extra (aiohttp, prometheus_client).
"""

from ..text.chat_template import ChatTemplate
from ..text.stream import IncrementalDetokenizer, TextStream
from .app import make_app
from .async_engine import AsyncEngine, EngineClosedError, EngineDeadError, EngineError, EngineStepError
from .choices import Choices
from .metrics import ServerMetrics

__all__ = [
    "AsyncEngine",
    "ChatTemplate",
    "Choices",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineStepError",
    "IncrementalDetokenizer",
    "ServerMetrics",
    "TextStream",
    "make_app",
]
