"""Configs, the floor everything stands on: a target's `ModelConfig` parsed from an HF config.json
(model.py: the three families, RoPE / YaRN, quantization) and an EAGLE-3 draft's `DraftConfig`
(draft.py). Frozen, hashable dataclasses, passed to jitted programs as static arguments."""
