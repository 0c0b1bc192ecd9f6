"""EAGLE-3 draft training: draft-vocabulary selection, training data from the target itself
(regeneration, teacher features online or from an offline feature store), and HF export.
"""

from ..text.chat_template import render_prompt
from .data import (
                   Example,
                   FeatureStore,
                   batch_order,
                   load_prompts,
                   online_batches,
                   pack,
                   regenerate,
                   teacher_batch,
                   write_feature_store,
)
from .export import export_hf_draft
from .vocab import DraftVocab, count_tokens, select_draft_vocab

__all__ = [
    "DraftVocab",
    "Example",
    "FeatureStore",
    "batch_order",
    "count_tokens",
    "export_hf_draft",
    "load_prompts",
    "online_batches",
    "pack",
    "regenerate",
    "render_prompt",
    "select_draft_vocab",
    "teacher_batch",
    "write_feature_store",
]
