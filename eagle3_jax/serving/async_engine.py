"""An asyncio front end for the single-threaded `Scheduler`.

`AsyncEngine` owns one background thread, the only thread that ever calls the scheduler. Event-loop
code talks to it through a thread-safe command queue (add a request, abort one, stop); the thread
drains the queue, calls `Scheduler.step()` while anything is unfinished, and otherwise blocks on the
queue, so an idle server uses no CPU. Each request's `RequestDelta`s go to an `asyncio.Queue` owned
by the caller's event loop: a step's deltas go over in one `loop.call_soon_threadsafe` per event
loop, not one per request (each such call wakes the loop's selector, a few microseconds of the
engine thread's time per running request and step).

    engine = AsyncEngine(scheduler, tokenizer=tokenizer)
    engine.start()
    async for delta in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(delta.token_ids, delta.text, delta.finish_reason)
    await engine.close()

With a tokenizer, every delta carries its text and the final delta's output the whole text: the
engine thread decodes what it must (requests with stop strings, to end them at the right token),
and `generate` decodes every other request as its deltas arrive, on the caller's event loop and off
the engine thread, with one `ChoiceText` per request (text/stream.py): each request is decoded once.
`choices` runs the n choices of one prompt (choices.py). The engine is the whole face the server
sees: its limits (`max_seq_len`, `max_logprobs`), whether it `speculates`, `stats()`, health.

Request validation errors (`ValueError`, `CapacityError`) are raised by the generator before its
first delta. A consumer that stops iterating early (closes the generator, is cancelled, or drops it)
aborts its request, so the KV pages are freed at once. An exception inside `step()` is logged and
fails every in-flight request with `EngineStepError`; after `max_consecutive_failures` failures in a
row the engine stops stepping and refuses new work with `EngineDeadError` (health checks see it
through `is_healthy`).

`stats()` counts from `start()`: what the scheduler did before is left out of the counters, tau
and per-position acceptance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from ..sampling.sampler import SamplingParams
from ..scheduler import CapacityError, RequestDelta, Scheduler, WarmUp  # noqa: F401 (CapacityError: the engine's face)
from ..scheduler.warmup import WarmUpQueue
from ..scheduler.metrics import stats_since
from ..text.stream import ChoiceText
from ..text.tokenizer import Tokenizer
from .choices import Choices

logger = logging.getLogger(__name__)

def with_text(delta: "RequestDelta", text: ChoiceText) -> "RequestDelta":
    """A delta with its new text, and on the final one the output's whole text, from the request's
    one decoder."""
    new = text.add(delta.token_ids, delta.text, delta.finished)
    output = delta.output
    if output is not None:
        output = dataclasses.replace(output, text=text.text)
    return dataclasses.replace(delta, text=new, output=output)


class EngineError(RuntimeError):
    """The engine could not run a request (not the request's fault)."""


class EngineStepError(EngineError):
    """`Scheduler.step()` raised while the request was in flight."""


class EngineDeadError(EngineError):
    """The engine stopped stepping after repeated failures; restart the server."""


class EngineClosedError(EngineError):
    """The engine was shut down (or never started)."""


@dataclasses.dataclass
class _Add:
    prompt_ids: list[int]
    sampling: Any
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    future: concurrent.futures.Future  # result: the request id; exception: add_request's error
    wait_for: str | None = None  # Scheduler.add_request's: admitted after this request's prefill


@dataclasses.dataclass
class _Abort:
    request_id: str
    detach: bool  # the consumer is gone: stop delivering to it now, not at the final delta


@dataclasses.dataclass
class _Call:
    fn: Any  # fn(scheduler), run on the engine thread
    future: concurrent.futures.Future


_STOP = object()


@dataclasses.dataclass
class _Stream:
    """Where one request's deltas go: a queue on the consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> bool:
        """Hand `item` to the consumer's loop; False when that loop is closed."""
        return _call_on(self.loop, self.queue.put_nowait, item)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Any, arg: Any) -> bool:
    """Have `loop` call fn(arg) (from another thread); False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, arg)
        return True
    except RuntimeError:  # the consumer's event loop is closed
        return False


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On a consumers' event loop: each item into its queue, in order."""
    for q, item in items:
        q.put_nowait(item)


def deliver(streams: dict[str, "_Stream"], deltas: list["RequestDelta"], abort: Callable[[str], None]) -> None:
    """Hand a step's deltas to their consumers' queues (`streams`, the engine thread's), one
    cross-thread call per event loop; a request whose loop is closed is aborted (nobody can read it)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta]]] = {}
    for delta in deltas:
        stream = streams.get(delta.request_id)
        if stream is None:
            continue  # its consumer detached (aborted) already
        if delta.finished:
            del streams[delta.request_id]
        elif not delta.token_ids:
            continue  # nothing new for the consumer
        by_loop.setdefault(stream.loop, []).append((stream.queue, delta))
    for loop, items in by_loop.items():
        if _call_on(loop, _put_all, items):
            continue
        for _, delta in items:
            if not delta.finished:
                streams.pop(delta.request_id, None)
                abort(delta.request_id)


class AsyncEngine:
    """Runs a `Scheduler` on one background thread and serves requests to asyncio code."""

    def __init__(self, scheduler: "Scheduler", *, tokenizer: Tokenizer | None = None, max_consecutive_failures: int = 3,
                 thread_name: str = "eagle3-engine"):
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1; got {max_consecutive_failures}")
        own = getattr(scheduler, "tokenizer", None)
        if tokenizer is not None and own is not None and own is not tokenizer:
            raise ValueError("the scheduler was built with another tokenizer; give the AsyncEngine the same one")
        if tokenizer is not None and own is None:
            scheduler.tokenizer = tokenizer  # it matches stop strings on the text (before the engine thread exists)
        self.scheduler = scheduler
        self.tokenizer: Tokenizer | None = tokenizer if tokenizer is not None else own
        self.max_consecutive_failures = int(max_consecutive_failures)
        self._thread_name = thread_name
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closing = False
        # Engine-thread state (never touched by other threads while the thread runs):
        self._streams: dict[str, _Stream] = {}
        self._failures_in_a_row = 0
        # Written by the engine thread, read anywhere: each is replaced whole, never mutated.
        self._stats: dict[str, Any] = {}
        self._baseline: dict[str, Any] = {}  # the scheduler's counters at start()
        self._dead: EngineDeadError | None = None
        self._warming: WarmUpQueue | None = None  # a warm-up compiling while the engine serves
        self.thread_id: int | None = None  # the engine thread's native id, once it runs
        self._step_seconds = self._deliver_seconds = 0.0  # wall time in Scheduler.step() and handing outputs over

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        """Start the engine thread (once). Returns self."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._baseline = dict(self.scheduler.stats())  # safe: the engine thread does not exist yet
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread and wait for it; in-flight requests fail with EngineClosedError.

        Blocks for up to `timeout` seconds (forever when None) while a running `step()` finishes.
        Safe to call more than once, and before `start()`.
        """
        self._closing = True
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)

    async def close(self, timeout: float | None = None) -> None:
        """`shutdown()` without blocking the event loop."""
        await asyncio.to_thread(self.shutdown, timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs and has not given up after repeated step failures."""
        return self.is_running and self._dead is None and not self._closing

    @property
    def warming(self) -> WarmUpQueue | None:
        """A background warm-up (`warm_up(background=True)`): its `ready`, `compiled`, `total`."""
        return self._warming

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine stopped stepping, or None."""
        return self._dead

    @property
    def max_seq_len(self) -> int:
        """Prompt plus generated tokens per request, at most."""
        return int(self.scheduler.max_seq_len)

    @property
    def max_logprobs(self) -> int:
        """Top alternatives per token a request may ask for, at most."""
        return int(getattr(self.scheduler, "max_logprobs", 0))

    @property
    def speculates(self) -> bool:
        """Whether requests run with a draft (their outputs then carry speculation's figures)."""
        return getattr(self.scheduler, "draft", None) is not None

    def choices(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1,
                request_id: str | None = None) -> "Choices":
        """The n choices of one prompt as one async context (see choices.Choices)."""
        return Choices(self, prompt_ids, sampling, n, request_id)

    # ---- requests --------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: "SamplingParams | None" = None,
                       request_id: str | None = None, wait_for: str | None = None) -> AsyncIterator["RequestDelta"]:
        """Run one request; yields its `RequestDelta`s, the last with `finished=True`, with their
        text (and the final output's) when the engine has a tokenizer. `wait_for`: another request of
        the same prompt, queued before (Scheduler.add_request).

        `add_request`'s ValueError / CapacityError is raised before any delta. Raises EngineError
        subclasses when the engine fails, is dead or is closed. Leaving the loop early, or being
        cancelled, aborts the request (its KV pages are freed at once).
        """
        self._check_accepting()
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        if sampling is not None and sampling.constraint is not None and self.scheduler.grammars is not None:
            # Compiled here, off the engine thread (which then finds it compiled): a new schema
            # never stalls the other requests' steps.
            await loop.run_in_executor(None, self.scheduler.grammars.compile, sampling.constraint)
        deltas: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add([int(t) for t in prompt_ids], sampling, rid, loop, deltas, added, wait_for))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            # If the engine thread already took the request, it will be added: abort it then.
            added.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                    else self._abort(rid, detach=True))
            raise
        finished = False
        text = None if self.tokenizer is None else ChoiceText(self.tokenizer, prompt_ids)
        try:
            while not finished:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = bool(item.finished)
                yield item if text is None else with_text(item, text)
        finally:
            if not finished:  # the consumer left early or was cancelled
                self._abort(rid, detach=True)

    def abort(self, request_id: str) -> None:
        """Ask the engine to abort `request_id`; its consumer then gets a final "abort" delta.

        Thread-safe and non-blocking; unknown or finished ids are ignored.
        """
        self._abort(request_id, detach=False)

    def stats(self) -> dict[str, Any]:
        """Snapshot of `scheduler.stats()` taken by the engine thread after its last step, counted
        from `start()`, plus `request_queue_depth` (commands not yet taken by the engine thread),
        `num_in_flight` (requests with a consumer attached), `engine_step_seconds_total` and
        `engine_deliver_seconds_total` (the engine thread's wall time in `Scheduler.step()` and
        handing the steps' outputs to their event loops) and `engine_healthy`."""
        snap = dict(self._stats)
        snap["request_queue_depth"] = self._commands.qsize()
        snap["engine_healthy"] = self.is_healthy
        return snap

    def warm_up(self, background: bool = False, progress: Callable[[str], None] | None = None) -> "WarmUp | int":
        """`Scheduler.warm_up` on the engine thread (JAX's dispatch caches are per thread); blocking, before
        serving: its report. `background`: its programs compile one at a time between requests, a lone
        greedy request's first (then `warming.ready`), while requests are served (one waits at most for
        the compile under way); `progress` hears how far it is, on the engine thread. Returns their number."""
        self._check_accepting()
        done: concurrent.futures.Future = concurrent.futures.Future()

        def queue(scheduler: Scheduler) -> int:
            self._warming = scheduler.warm_up_queue(progress=progress)
            return self._warming.total

        self._commands.put(_Call(queue if background else lambda scheduler: scheduler.warm_up(), done))
        return done.result()

    def _abort(self, request_id: str, detach: bool) -> None:
        if self.is_running:
            self._commands.put(_Abort(request_id, detach))

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            raise EngineClosedError("the engine is not running: call AsyncEngine.start() first")
        if self._closing or not self._thread.is_alive():
            raise EngineClosedError("the engine has been shut down")

    # ---- the engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        self.thread_id = threading.get_native_id()
        try:
            while True:
                warming = self._warming is not None and not self._warming.finished
                busy = self._dead is None and (self.scheduler.has_unfinished() or warming)
                commands = self._take_commands(block=not busy)
                if any(c is _STOP for c in commands):
                    self._finish_commands(commands)
                    break
                for command in commands:
                    self._handle(command)
                if self._dead is None and self.scheduler.has_unfinished():
                    self._step()
                elif self._dead is None and warming:
                    self._warming.compile_next(self.scheduler.warm)
                elif commands:
                    self._stats = self._snapshot()
        except BaseException as e:  # a bug in this loop: never leave consumers waiting forever
            logger.exception("the engine thread crashed")
            self._dead = EngineDeadError(f"the engine thread crashed: {type(e).__name__}: {e}")
            self._fail_all(self._dead)
            raise
        finally:
            self._shut_down_in_flight()

    def _take_commands(self, block: bool) -> list[Any]:
        """Every queued command; with `block`, waits for at least one first (the idle state)."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort_now(command)
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.scheduler))
            except Exception as e:
                command.future.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the caller was cancelled before the request reached the scheduler
        if self._dead is not None:
            cmd.future.set_exception(self._dead)
            return
        try:
            extra = {} if cmd.wait_for is None else {"wait_for": cmd.wait_for}
            rid = self.scheduler.add_request(cmd.prompt_ids, cmd.sampling, request_id=cmd.request_id, **extra)
        except Exception as e:  # ValueError / CapacityError: the request's fault; goes to the caller
            cmd.future.set_exception(e)
            return
        self._streams[rid] = _Stream(cmd.loop, cmd.queue)
        cmd.future.set_result(rid)

    def _abort_now(self, cmd: _Abort) -> None:
        if cmd.detach:
            self._streams.pop(cmd.request_id, None)
        try:
            self.scheduler.abort(cmd.request_id)
        except Exception:
            logger.exception("Scheduler.abort(%r) failed", cmd.request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            deltas = self.scheduler.step()
        except Exception as e:
            self._on_step_failure(e)
        else:
            stepped = time.perf_counter()
            self._step_seconds += stepped - start
            self._failures_in_a_row = 0
            deliver(self._streams, deltas, lambda rid: self._abort_now(_Abort(rid, detach=True)))
            self._deliver_seconds += time.perf_counter() - stepped
        self._stats = self._snapshot()

    def _on_step_failure(self, exc: Exception) -> None:
        self._failures_in_a_row += 1
        logger.exception("Scheduler.step() failed (%d in a row); failing %d in-flight request(s)",
                         self._failures_in_a_row, len(self._streams))
        error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for rid in list(self._streams):  # free their pages if the scheduler still can
            try:
                self.scheduler.abort(rid)
            except Exception:
                logger.exception("Scheduler.abort(%r) failed after a step failure", rid)
        # Stop before failing the requests: a client that gets its error and asks /health at once
        # must already see the engine down.
        if self._failures_in_a_row >= self.max_consecutive_failures:
            self._dead = EngineDeadError(
                f"the engine stopped after {self._failures_in_a_row} failed steps in a row; last error: "
                f"{type(exc).__name__}: {exc}. Check the server log and restart the server")
            logger.error("%s", self._dead)
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    def _finish_commands(self, commands: list[Any]) -> None:
        """At shutdown: refuse adds and calls that were still queued; aborts need no answer."""
        closed = EngineClosedError("the engine was shut down before this request started")
        for command in commands:
            if isinstance(command, (_Add, _Call)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(closed)

    def _shut_down_in_flight(self) -> None:
        for rid in list(self._streams):
            try:
                self.scheduler.abort(rid)
            except Exception:
                logger.exception("Scheduler.abort(%r) failed at shutdown", rid)
        self._fail_all(EngineClosedError("the engine was shut down while this request ran"))
        self._finish_commands(self._take_commands(block=False))
        try:
            self._stats = self._snapshot()
        except Exception:
            logger.exception("Scheduler.stats() failed at shutdown")

    def _snapshot(self) -> dict[str, Any]:
        stats = stats_since(dict(self.scheduler.stats()), self._baseline)
        stats["num_in_flight"] = len(self._streams)
        stats["engine_step_seconds_total"] = self._step_seconds
        stats["engine_deliver_seconds_total"] = self._deliver_seconds
        return stats
