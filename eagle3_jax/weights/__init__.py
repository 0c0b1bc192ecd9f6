"""Weights as arrays: the parameter layout of targets and drafts (params.py: names, shapes, logical
axes, flat <-> stacked trees), HF key names (weights/keymap.py), quantized arrays that stay packed on device
with the ops that dequantize them in place (quant.py), and host arrays read lazily from a
checkpoint (lazy.py)."""
