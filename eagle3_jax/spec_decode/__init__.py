"""Speculative decoding: tree topology (tree.py), draft proposals (propose.py), verification
(verify.py), the step programs (step.py) and adaptive speculation (adaptive.py)."""

from .settings import AutoSpec
from .settings import SpecConfig

__all__ = ["AutoSpec", "SpecConfig"]
