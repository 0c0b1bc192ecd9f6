"""Constrained output, host side: what a request constrains its output to (`Constraint`: a JSON
schema, any JSON object, a regex, a choice of strings, a Lark / GBNF grammar), compiled once per
distinct constraint and vocabulary (`GrammarCache`), and a per-request `Matcher` that says which
tokens may come next (a bitmask over the model's vocabulary), advanced by accepted tokens and
rolled back; `RequestGrammar` (guide.py) is that matcher as decoding goes: the mask of the next
token, of every node of a draft tree, and the tokens emitted. The grammar engine is `llguidance` (no torch; any byte vocabulary, Kimi's tiktoken
one too).
"""

from .constraints import Constraint, ConstraintError
from .guide import GrammarViolation, RequestGrammar, batch_masks, batch_tree_masks, mask_words
from .matcher import GrammarCache, Matcher, vocabulary

__all__ = ["Constraint", "ConstraintError", "GrammarCache", "GrammarViolation", "Matcher", "RequestGrammar",
           "batch_masks", "batch_tree_masks", "mask_words", "vocabulary"]
