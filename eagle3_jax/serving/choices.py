"""The n choices of one prompt, run as n engine requests and read as one interleaved stream.

Choice i samples with seed + i (vLLM's rule, so a seeded request of n choices reproduces); the
choices after the first are admitted once the first has prefilled, so with the scheduler's prefix
cache they take the prompt's full pages instead of computing them again. Usable from any asyncio
code, not only the server:

    async with engine.choices(prompt_ids, sampling, n=4) as choices:
        await choices.start()                  # add_request's errors come here, before any output
        async for index, delta in choices:     # every choice's deltas, as they come
            ...

Leaving the context early aborts the choices still running (their KV pages are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Sequence

from ..sampling.sampler import SamplingParams

if TYPE_CHECKING:
    from ..scheduler import RequestDelta


class RequestStreams(Protocol):
    """What the choices need of an engine (AsyncEngine is one): a request's deltas as a stream."""

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                 request_id: str | None = None, wait_for: str | None = None) -> AsyncIterator["RequestDelta"]: ...

SEED_LIMIT = 2**32  # SamplingParams seeds are uint32


def choice_samplings(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's SamplingParams: choice i draws with seed + i."""
    return [dataclasses.replace(sampling, seed=(sampling.seed + i) % SEED_LIMIT) for i in range(n)]


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of n choices (the request's own id for one choice)."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class Choices:
    """The n choices of one prompt (see the module doc)."""

    def __init__(self, engine: RequestStreams, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1,
                 request_id: str | None = None):
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        self.engine, self.prompt_ids, self.n = engine, list(prompt_ids), int(n)
        self.samplings = choice_samplings(sampling, self.n)
        self.ids = choice_ids(request_id if request_id is not None else f"req-{uuid.uuid4().hex}", self.n)
        self.firsts: list["RequestDelta"] = []
        self._stack = contextlib.AsyncExitStack()
        self._streams: list[Any] = []

    async def __aenter__(self) -> "Choices":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.aclose()  # closing a choice's stream before its end aborts it

    async def start(self) -> list["RequestDelta"]:
        """Queue every choice (in order) and wait for each one's first delta; the engine's
        ValueError / CapacityError for the request is raised here, before any output."""
        for i, (rid, sampling) in enumerate(zip(self.ids, self.samplings)):
            stream = self.engine.generate(self.prompt_ids, sampling, rid, wait_for=None if i == 0 else self.ids[0])
            self._streams.append(await self._stack.enter_async_context(contextlib.aclosing(stream)))
        starts = [asyncio.ensure_future(anext(stream)) for stream in self._streams]
        try:
            self.firsts = [await start for start in starts]
        finally:
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
        return self.firsts

    async def __aiter__(self) -> AsyncIterator[tuple[int, "RequestDelta"]]:
        """(choice index, delta) for every delta of every choice, the first deltas first; an engine
        error of any choice is raised."""
        if not self.firsts:
            await self.start()
        merged: asyncio.Queue = asyncio.Queue()  # (index, delta or exception), choices interleaved

        async def forward(index: int) -> None:
            delta = self.firsts[index]
            try:
                await merged.put((index, delta))
                while not delta.finished:
                    delta = await anext(self._streams[index])
                    await merged.put((index, delta))
            except Exception as e:  # an engine error: the reader reports it
                await merged.put((index, e))

        forwards = [asyncio.ensure_future(forward(i)) for i in range(self.n)]
        try:
            running = self.n
            while running:
                index, delta = await merged.get()
                if isinstance(delta, Exception):
                    raise delta
                running -= bool(delta.finished)
                yield index, delta
        finally:
            for task in forwards:
                task.cancel()
            await asyncio.gather(*forwards, return_exceptions=True)
