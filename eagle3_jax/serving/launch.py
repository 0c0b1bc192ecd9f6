"""Starting the HTTP server around a running engine (what `scripts/serve.py` does after the model
loads): the output parsers in effect for the model, the ids requests stop at, the start-up's
long-lived objects kept out of later garbage collections, and the app run until stopped."""

from __future__ import annotations

import gc
from typing import Sequence

from ..parsers.defaults import AUTO, NONE, OutputParsers, output_parsers, template_text  # noqa: F401 (launch's names too)
from .async_engine import AsyncEngine
from .errors import web

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
