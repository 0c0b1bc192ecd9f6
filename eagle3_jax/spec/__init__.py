"""Speculative decoding: tree topology (tree.py), draft proposals (propose.py), verification
(verify.py), the step programs (step.py) and adaptive speculation (adaptive.py)."""

from .adaptive import AutoSpec
from .tree import SpecConfig

__all__ = ["AutoSpec", "SpecConfig"]
