"""The request layer: one request's checks, budget, emitted tokens, finish and metrics.

Every front end (`Engine.generate`, `Scheduler`, the OpenAI server) goes through these, so a rule
about requests (what is refused, what is capped, when a request stops, what its metrics mean) is
written once:

- `check_request`: a prompt and its SamplingParams, refused with a ValueError naming the problem.
- `token_budget`: the tokens a request may generate, max_tokens cut to the room left in
  max_seq_len; `cap_message` says so (front ends report every cap, none is silent).
- `Request.emit`: a step's tokens (and their logprobs, when asked for) appended up to a stop
  token, a stop string (text/stream.py), the end of its grammar (structured output: the grammar
  complete, or the end-of-sequence token where it may end) or the budget; the finish reason.
  Tokens a speculative step accepted past the stop are dropped, neither emitted nor counted.
- `Request.metrics` -> `RequestOutput.metrics`: acceptance, passes, latencies.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Iterable, Sequence

from .sampling.logprobs import Logprob
from .sampling.sampler import SamplingParams
from .structured import GrammarViolation, RequestGrammar
from .text.stream import TextStream

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or string) | "length" (max_tokens or max_seq_len) | "abort"
    _metrics: dict | Callable[[], dict] = dataclasses.field(repr=False, compare=False)  # see `metrics`
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)
    text: str | None = None  # the decoded output, cut at a stop string (filled by the front ends, see text/stream.py)
    logprobs: list[Logprob] | None = None  # one per output token (SamplingParams.logprobs), else None
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token, None for the first one

    @property
    def metrics(self) -> dict:
        """Acceptance, passes and latencies (`Request.metrics`), computed when first read: the
        serving loop that finishes a request does not compute what its front end may never read."""
        if callable(self._metrics):
            self._metrics = self._metrics()
        return self._metrics


def check_request(vocab_size: int, max_seq_len: int, prompt: Sequence[int], sampling: SamplingParams,
                  index: int = 0, *, decodes_text: bool = False, max_logprobs: int = 0) -> list[int]:
    """A request's prompt as a list of ints, after checking it and its sampling (stop strings need
    a front end that `decodes_text`; at most `max_logprobs` top alternatives per token); raises
    ValueError."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling[{index}] must be a SamplingParams, got {type(sampling).__name__}")
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(sampling, name)
        if asked is not None and asked > max_logprobs:
            raise ValueError(f"sampling[{index}] asks for {name}={asked} top alternatives, more than this engine's "
                             f"max_logprobs={max_logprobs}; ask for fewer or raise max_logprobs")
    if sampling.stop and not decodes_text:
        raise ValueError(f"sampling[{index}] has stop strings, which are matched on the decoded text: give the "
                         "Engine or Scheduler a tokenizer (tokenizer=load_tokenizer(model_folder))")
    if sampling.constraint is not None and not decodes_text:
        raise ValueError(f"sampling[{index}] has a constraint, whose grammar reads the tokenizer's vocabulary: give "
                         "the Engine or Scheduler a tokenizer (tokenizer=load_tokenizer(model_folder))")
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError(f"prompt {index} must be a sequence of integer token ids") from None
    if not ids:
        raise ValueError(f"prompt {index} is empty; give at least one token (e.g. BOS)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"prompt {index} has {len(ids)} tokens, which leaves no room to generate within max_seq_len="
            f"{max_seq_len}; shorten the prompt or raise max_seq_len"
        )
    return ids


def token_budget(prompt_len: int, max_tokens: int, max_seq_len: int) -> int:
    """Tokens a request may generate: max_tokens, cut to the room left in max_seq_len."""
    return min(max_tokens, max_seq_len - prompt_len)


def cap_message(prompt_len: int, max_tokens: int, max_seq_len: int, max_tokens_name: str = "max_tokens",
                max_seq_len_name: str = "max_seq_len") -> str | None:
    """What `token_budget` cut, in one sentence (None when max_tokens fits)."""
    budget = token_budget(prompt_len, max_tokens, max_seq_len)
    if budget == max_tokens:
        return None
    return (f"{max_tokens_name}={max_tokens} was cut to {budget}: the prompt's {prompt_len} tokens plus "
            f"{max_tokens_name} must fit {max_seq_len_name}={max_seq_len}")


def normalize_sampling(sampling: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from None (defaults), one for all, or one each."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * n
    sampling = list(sampling)
    if len(sampling) != n:
        raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts; give one or one per prompt")
    return sampling


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One request as its front ends see it: what it asked for and what it got so far. (Slotted:
    the serving loop reads and updates every running request's fields each step.)"""

    id: str
    prompt: list[int]
    sampling: SamplingParams
    budget: int  # most tokens it may generate (token_budget)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    output: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens emitted per decode step
    step_depths: list[int] = dataclasses.field(default_factory=list)  # draft tokens each decode step proposed
    draft_passes: int = 0
    admitted: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission
    sent: int = 0  # tokens already handed out
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: TextStream | None = None  # its decoded text, where stop strings are matched (None: no stop strings;
    # the front end that delivers its deltas decodes it)
    logprobs: list[Logprob] | None = None  # per output token, when the sampling asks for them
    prompt_logprobs: list[Logprob | None] | None = None  # per prompt token so far, when asked for
    grammar: RequestGrammar | None = None  # structured output: where its grammar stands (None: unconstrained)
    _stops: frozenset = dataclasses.field(init=False, repr=False, default=frozenset())  # sampling.stop_token_ids

    def __post_init__(self) -> None:
        if self.sampling.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self._stops = frozenset(self.sampling.stop_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    def record_step(self, emitted: int, depth: int, draft_passes: int) -> None:
        """A decode step that committed `emitted` tokens after proposing `depth` draft tokens."""
        self.accept_lengths.append(emitted)
        self.step_depths.append(depth)
        self.draft_passes += draft_passes

    def record_steps(self, emitted: list[int], depths: list[int], times: list[float], draft_passes: int) -> None:
        """Decode steps whose tokens were emitted untimed (`emit(timed=False)`, `take`), from a
        scheduler's step log: each committed `emitted` tokens after proposing `depths` draft
        tokens, and its tokens reached the host at `times`; `draft_passes` in all. Tokens a stop
        dropped get no time."""
        self.accept_lengths += emitted
        self.step_depths += depths
        for when, count in zip(times, emitted):
            self.token_times += [when] * count
        del self.token_times[len(self.output):]
        self.draft_passes += draft_passes

    @property
    def reads_tokens(self) -> bool:
        """Whether something reads its tokens one by one as they come (stop strings, a grammar,
        logprobs): then every step's tokens go through `emit`, never out in bulk."""
        return self.text is not None or self.grammar is not None or self.logprobs is not None

    def take(self, tokens: list[int]) -> None:
        """A step's tokens taken whole and marked handed out: tokens that cannot end the request
        (none a stop id, its budget not reached) of a request that does not `reads_tokens`, all
        earlier ones handed out (the scheduler checks that for a whole batch at once); their
        time is the caller's to record (`record_steps`)."""
        self.output += tokens
        self.sent = len(self.output)

    def emit(self, tokens: Sequence[int], now: float, logprobs: Sequence[Logprob] | None = None,
             timed: bool = True) -> str | None:
        """Append a step's tokens (and their `logprobs`, one each, where the request asks for
        them), up to and including a stop token, the one that ends its grammar or the budget's
        last; returns the finish reason then ("stop" / "length"), else None. Tokens past the
        finish are dropped. `timed`: record `now` as their time (False: a step log records the
        step's time, `record_steps`). A grammar's end ends the output even below min_tokens
        (nothing else may follow it). A token the grammar forbids (a masking bug, logged) ends the request
        ("abort"), never the engine."""
        stops = self._stops
        for i, tok in enumerate(tokens):
            tok = int(tok)
            self.output.append(tok)
            if timed:
                self.token_times.append(now)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            try:
                grammar_done = self.grammar is not None and self.grammar.accept(tok)
            except GrammarViolation as e:
                logger.error("request %s: %s; the request is ended", self.id, e)
                return FINISH_ABORT
            if tok in stops and len(self.output) >= self.sampling.min_tokens:
                self.stop_reason = tok
                return FINISH_STOP
            if self.text is not None and self.text.push([tok]):
                self.stop_reason = self.text.stop
                return FINISH_STOP
            if grammar_done:
                return FINISH_STOP
            if len(self.output) >= self.budget:
                return FINISH_LENGTH
        return None

    def unsent(self) -> tuple[list[int], list[Logprob] | None, str | None]:
        """The tokens not handed out yet, their logprobs (None: not asked for) and, where the request
        layer decodes this request, their settled text (else None); marks them handed out."""
        start, self.sent = self.sent, len(self.output)
        text = None if self.text is None else self.text.take()
        return self.output[start:], None if self.logprobs is None else self.logprobs[start:], text

    def missing_prompt_logprobs(self, first: int, count: int) -> range:
        """Of prompt tokens `first` .. `first` + count - 1 (what a prefill chunk predicts), those
        whose logprobs are still to record: none recorded already, none past the prompt (a
        recomputed output)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(first, len(self.prompt_logprobs)), min(first + count, len(self.prompt)))

    def metrics(self, now: float, max_depth: int) -> dict:
        """Per-request metrics: acceptance (per draft position up to `max_depth`, over the steps
        that proposed that deep), target and draft passes, and latencies from arrival."""
        acc, drafted, times = self.accept_lengths, self.step_depths, self.token_times
        per_position = []  # plain Python: a finishing request's metrics are on the serving loop's path
        for d in range(1, max_depth + 1):
            reached = [a - 1 >= d for a, n in zip(acc, drafted) if n >= d]
            per_position.append(sum(reached) / len(reached) if reached else 0.0)
        return {
            "mean_accept_length": sum(acc) / len(acc) if acc else 1.0,
            "num_draft_tokens": sum(drafted),  # proposed to verify passes
            "num_accepted_tokens": sum(a - 1 for a, n in zip(acc, drafted) if n > 0 and a > 1),  # draft tokens accepted
            "accept_lengths": list(acc),
            "per_position_acceptance": per_position,
            "num_target_passes": len(acc) + (1 if times else 0),  # the prefill's pass gave the first token
            "num_draft_passes": self.draft_passes,
            "num_output_tokens": len(self.output),
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
            "queue_s": (self.admitted if self.admitted is not None else now) - self.arrival,
            "ttft_s": times[0] - self.arrival if times else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])],
            "e2e_latency_s": now - self.arrival,
        }

    def settle_text(self) -> str | None:
        """At the finish, the text not handed out yet (None: the request layer does not decode this
        request, see text/stream.py). A stop string found only once the last tokens settle (an
        incomplete character before) still ends the text, and finishes the request as stopped."""
        if self.text is None:
            return None
        if self.text.push([], final=True) and self.finish_reason == FINISH_LENGTH:
            self.finish_reason, self.stop_reason = FINISH_STOP, self.text.stop
        return self.text.take(final=True)

    def output_record(self, now: float, max_depth: int, text: str | None = None) -> RequestOutput:
        return RequestOutput(self.output, self.finish_reason, functools.partial(self.metrics, now, max_depth),
                             self.stop_reason, text, self.logprobs, self.prompt_logprobs)


def pooled_acceptance(accept_lengths: Iterable[Sequence[int]], max_accept: int) -> dict:
    """tau and per-position acceptance pooled over every verify step of every request (each request's
    `accept_lengths`, as its metrics give them).

    tau = mean accept length (bonus token included; 1.0 when there was no verify step);
    per_position[d - 1] = fraction of steps with accept length - 1 >= d, for d = 1..max_accept.
    """
    steps = [int(a) for lengths in accept_lengths for a in lengths]
    if not steps:
        return {"tau": 1.0, "per_position": [0.0] * max_accept, "num_verify_steps": 0}
    return {"tau": sum(steps) / len(steps),
            "per_position": [sum(a - 1 >= d for a in steps) / len(steps) for d in range(1, max_accept + 1)],
            "num_verify_steps": len(steps)}
