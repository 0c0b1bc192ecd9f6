"""Constrained output, host side: what a request constrains its output to (`Constraint`: a JSON
schema, any JSON object, a regex, a choice of strings, a Lark / GBNF grammar), compiled once per
distinct constraint and vocabulary (`GrammarCache`), and a per-request `Matcher` that says which
tokens may come next (a bitmask over the model's vocabulary), advanced by accepted tokens and
rolled back. The grammar engine is `llguidance` (no torch; any byte vocabulary, Kimi's tiktoken
one too).
"""

from .constraints import Constraint, ConstraintError
from .matcher import GrammarCache, Matcher, vocabulary

__all__ = ["Constraint", "ConstraintError", "GrammarCache", "Matcher", "vocabulary"]
