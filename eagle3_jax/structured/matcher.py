"""Grammars compiled once, and the per-request matcher that says which tokens may come next.

`vocabulary(tokenizer, vocab_size)` is llguidance's view of a model's vocabulary (built once per
tokenizer and size: about a second for a 160k vocabulary), from the tokenizer.json or Kimi's
tiktoken ranks, padded to the model's `vocab_size` (ids the tokenizer lacks are never allowed);
the tokenizer's EOS ids end the grammar. `GrammarCache` compiles each distinct `Constraint` once
(bounded, least recently used first out) under llguidance's resource limits, so a schema too
large or too slow to compile is a ConstraintError, not a stalled server. A `Matcher` is one
request's state: `allowed()` is the bitmask of the tokens that may come next (int32 words, bit
`t % 32` of word `t // 32`), `advance(tokens)` consumes accepted ones, `rollback(n)` takes back
the last n, `accepting` says whether the output may end here.
"""

from __future__ import annotations

import collections
import functools
import threading
import time

import llguidance
import llguidance.numpy as llnp
import numpy as np

from ..text.tiktoken_tokenizer import TiktokenBackend
from ..text.tokenizer import Tokenizer
from .constraints import Constraint, ConstraintError

# Work bounds for one grammar: llguidance's lexer fuel and Earley items (about 20 ms of lexer
# building, 15 ms per token at the most), a grammar size bound; a compile over COMPILE_SECONDS
# is refused too (the cache keeps what was built).
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000)
COMPILE_SECONDS = 10.0


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over `tokenizer`'s vocabulary, `vocab_size` ids long."""
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's "
                         f"({tokenizer.vocab_size})")
    eos = list(tokenizer.eos_ids) or None
    backend = tokenizer.backend
    if isinstance(backend, TiktokenBackend):
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(backend.encoding, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(backend.hf.to_str(), n_vocab=vocab_size, eos_token=eos)


class Matcher:
    """One request's position in its grammar (module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        """llguidance's matcher (for its batched calls)."""
        return self._m

    @property
    def accepting(self) -> bool:
        """Whether the output may end here (the grammar is complete)."""
        return self._m.is_accepting()

    @property
    def finished(self) -> bool:
        """Whether nothing but the end may follow (the grammar stopped, or failed)."""
        return self._m.is_stopped() or self._m.is_error()

    def allowed(self, out: np.ndarray | None = None) -> np.ndarray:
        """The bitmask [ceil(vocab / 32)] int32 of the tokens that may come next (into `out`)."""
        mask = llnp.allocate_token_bitmask(1, self.vocab_size) if out is None else out.reshape(1, -1)
        llnp.fill_next_token_bitmask(self._m, mask, 0)
        return mask[0]

    def advance(self, tokens: list[int]) -> bool:
        """Consume accepted tokens; False (and the matcher in error) if the grammar forbids one."""
        return self._m.consume_tokens([int(t) for t in tokens])

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows from here, without consuming them."""
        return self._m.validate_tokens([int(t) for t in tokens])

    def rollback(self, n: int) -> None:
        """Take back the last `n` consumed tokens."""
        if n and not self._m.rollback(n):
            raise RuntimeError(f"the grammar could not take back {n} tokens: {self._m.get_error()}")

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCache:
    """Compiled grammars of one vocabulary, by constraint, at most `max_entries` kept."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_entries: int = 64,
                 compile_seconds: float = COMPILE_SECONDS):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_entries, self.compile_seconds = max_entries, compile_seconds
        self._limits = llguidance.LLParserLimits(**LIMITS)
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = constraint.grammar_text()
        try:
            vocab = vocabulary(self.tokenizer, self.vocab_size)
        except ValueError as e:
            raise ConstraintError(f"this model's tokenizer cannot be read by the grammar engine, so its output cannot "
                                  f"be constrained: {e}") from None
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ConstraintError(f"the {constraint.kind.replace('_', ' ')} cannot be used: {matcher.get_error()}")
        spent = time.perf_counter() - start
        if spent > self.compile_seconds:
            raise ConstraintError(f"the {constraint.kind.replace('_', ' ')} took {spent:.1f} s to compile (the bound is "
                                  f"{self.compile_seconds:.0f} s); simplify it")
        return matcher

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar; ConstraintError for one that
        cannot be compiled."""
        return Matcher(self.compile(constraint).deep_copy(), self.vocab_size)

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """`constraint`'s compiled grammar (compiled now unless cached); ConstraintError for one
        that cannot be compiled."""
        key = constraint.key
        with self._lock:
            base = self._compiled.get(key)
            if base is not None:
                self._compiled.move_to_end(key)
        if base is None:
            base = self._compile(constraint)
            with self._lock:
                self._compiled[key] = base
                while len(self._compiled) > self.max_entries:
                    self._compiled.popitem(last=False)
        return base

    def __len__(self) -> int:
        return len(self._compiled)
