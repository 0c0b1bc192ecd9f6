"""Serving: an asyncio front end for the continuous-batching scheduler and an OpenAI-compatible
HTTP API over it (`scripts/serve.py` runs both).

    engine = AsyncEngine(Scheduler(target, draft, spec)).start()
    app = make_app(engine, tokenizer, "my-model")     # aiohttp web.Application
"""

from ..text_stream import IncrementalDetokenizer, TextStream
from .async_engine import AsyncEngine, EngineClosedError, EngineDeadError, EngineError, EngineStepError
from .metrics import ServerMetrics
from .openai_api import ChatTemplate, make_app

__all__ = [
    "AsyncEngine",
    "ChatTemplate",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineStepError",
    "IncrementalDetokenizer",
    "ServerMetrics",
    "TextStream",
    "make_app",
]
