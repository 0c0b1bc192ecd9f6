"""One request's grammar as decoding goes: the masks a step needs, and the tokens it accepted.

A step applies, at every position it judges, the bitmask of the tokens the grammar allows there
(`mask_words(vocab)` int32 words, bit `t % 32` of word `t // 32`; every bit set: no constraint).
A plain step judges one position per row (`next_mask`); a speculative step judges every node of
its draft tree, each under the grammar's state after the draft tokens on its path (`tree_masks`:
the tree walked depth first, the matcher advanced into each node and rolled back out of it). A
node whose token its parent's mask forbids can never be accepted (the target's masked logits give
it no probability), so its subtree keeps all bits set, unread. Only the tokens a step emits move
the grammar for good (`accept`).

With `after_token` (the end of a reasoning model's thinking) the grammar is not live until that
token is output: before it every token is allowed, and in a tree the nodes below such a token
start the grammar afresh.

Chains (each node the child of the one before) of live grammars are filled by llguidance in one
call for the whole batch, on its own threads (`fill_next_token_bitmask_par_with_draft_tokens`);
other trees are walked in Python, row by row.
"""

from __future__ import annotations

from typing import Sequence

import functools

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .constraints import Constraint
from .matcher import GrammarCache, Matcher

ALL_TOKENS = -1  # an int32 mask word with every bit set


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow reached `accept` (a masking bug, never the request's)."""


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether bitmask `mask` [words] has token `token`'s bit set."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class RequestGrammar:
    """A request's matcher and whether its grammar has started (module docstring)."""

    def __init__(self, matcher: Matcher, after_token: int | None = None):
        self.matcher, self.after_token = matcher, after_token
        self.live = after_token is None
        self.words = mask_words(matcher.vocab_size)

    @staticmethod
    def of(grammars: GrammarCache | None, constraint: Constraint | None) -> "RequestGrammar | None":
        """A request's grammar at its start (compiled in `grammars` once per constraint; None
        without a constraint); ValueError without a cache (no tokenizer), ConstraintError for a
        constraint that cannot be compiled."""
        if constraint is None:
            return None
        if grammars is None:
            raise ValueError("constrained output reads the tokenizer's vocabulary: give the Engine or Scheduler a "
                             "tokenizer (tokenizer=load_tokenizer(model_folder))")
        return RequestGrammar(grammars.matcher(constraint), constraint.after_token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the output may follow."""
        return self.live and self.matcher.finished

    def next_mask(self, out: np.ndarray) -> None:
        """The tokens allowed next, into `out` [words]."""
        if self.live:
            self.matcher.allowed(out)
        else:
            out[:] = ALL_TOKENS

    def accept(self, token: int) -> bool:
        """An emitted token; True when it completes the grammar (the output ends there)."""
        if not self.live:
            self.live = token == self.after_token
            return False
        if not self.matcher.advance([token]):
            raise GrammarViolation(f"token {token} is not allowed by the grammar here: {self.matcher.error}")
        return self.matcher.finished

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int], out: np.ndarray) -> None:
        """The mask at each node of a draft tree (node 0: the last emitted token; parents before
        children) into `out` [N, words]."""
        out[:] = ALL_TOKENS
        children: list[list[int]] = [[] for _ in tokens]
        for node in range(1, len(tokens)):
            children[int(parents[node])].append(node)
        self._visit(0, self.live, [int(t) for t in tokens], children, out)

    def _visit(self, node: int, live: bool, tokens: list[int], children: list[list[int]], out: np.ndarray) -> None:
        """Masks of `node`'s subtree; the matcher stands after `node` (when `live`)."""
        if live:
            self.matcher.allowed(out[node])
        for child in children[node]:
            token = tokens[child]
            if not live:  # still reasoning: the grammar starts below the end token
                self._visit(child, token == self.after_token, tokens, children, out)
            elif allows(out[node], token) and self.matcher.advance([token]):
                self._visit(child, True, tokens, children, out)
                self.matcher.rollback(1)


def batch_masks(grammars: Sequence[RequestGrammar | None], batch: int, words: int) -> np.ndarray:
    """[batch, words]: each row's next mask (rows without a grammar, and padding: every token)."""
    masks = np.full((batch, words), ALL_TOKENS, np.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.next_mask(masks[row])
    return masks


def batch_tree_masks(grammars: Sequence[RequestGrammar | None], tokens: np.ndarray, parents: np.ndarray,
                     words: int) -> np.ndarray:
    """[batch, N, words]: the masks at every node of each row's tree (`tokens`, `parents` [batch, N])."""
    batch, n = tokens.shape
    masks = np.full((batch, n, words), ALL_TOKENS, np.int32)
    chain = bool((parents[:, 1:] == np.arange(n - 1)[None, :]).all())
    chains = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        if chain and grammar.live:
            chains.append((grammar.matcher.llmatcher, row * n, [int(t) for t in tokens[row, 1:]]))
        else:
            grammar.tree_masks(tokens[row], parents[row], masks[row])
    if chains:
        flat = masks.reshape(batch * n, words)
        rows = np.concatenate([np.arange(start, start + n) for _, start, _ in chains])
        flat[rows] = 0
        llnp.fill_next_token_bitmask_par_with_draft_tokens(_executor(), chains, flat)
        # past a draft token the grammar forbids, llguidance leaves the masks empty: those nodes are
        # never reached, and an empty mask would make their distributions undefined
        empty = rows[~flat[rows].any(axis=1)]
        flat[empty] = ALL_TOKENS
    return masks


@functools.lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for filling many matchers' masks at once."""
    return llguidance.LLExecutor()
