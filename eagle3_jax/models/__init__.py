"""The models' forward passes: layers, attention (GQA and MLA, XLA or kernels), MoE, the target
(target.py: load_target, Target) and the EAGLE-3 draft (draft.py: load_draft, Draft), and the
batch-invariant forms of their ops (invariant.py)."""
