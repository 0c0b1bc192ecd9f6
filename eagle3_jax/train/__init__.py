"""EAGLE-3 draft training: draft-vocabulary selection, training data from the target itself
(regeneration, teacher features online or from an offline feature store), and HF export;
draft_run.py strings them together after regeneration (what scripts/train_draft.py runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.exports import lazy_exports

# each public name and the module that defines it, imported on first use (runtime/exports.py)
_WHERE = {
    "DraftVocab": ".vocab",
    "Example": ".data",
    "FeatureStore": ".feature_store",
    "batch_order": ".data",
    "count_tokens": ".vocab",
    "export_hf_draft": ".export",
    "load_prompts": ".data",
    "online_batches": ".data",
    "pack": ".data",
    "regenerate": ".data",
    "render_prompt": "..text.chat_template",
    "select_draft_vocab": ".vocab",
    "teacher_batch": ".data",
    "teacher_head": ".data",
    "write_feature_store": ".feature_store",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:  # the same names for type checkers and the structure test
    from ..text.chat_template import render_prompt
    from .data import (Example, batch_order, load_prompts, online_batches, pack, regenerate, teacher_batch,
                       teacher_head)
    from .feature_store import FeatureStore, write_feature_store
    from .export import export_hf_draft
    from .vocab import DraftVocab, count_tokens, select_draft_vocab
