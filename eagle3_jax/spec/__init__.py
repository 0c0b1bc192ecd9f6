"""Speculative decoding: tree topology (tree.py), draft proposals (propose.py), verification (verify.py)."""

from .tree import SpecConfig

__all__ = ["SpecConfig"]
