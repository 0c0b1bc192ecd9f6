"""The one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as the config describes; the message names the tensor
    key or file at fault and the fix."""
