"""Choosing tokens: `SamplingParams`, the per-row settings packed for the device and the sampling,
penalty and masking ops of one step (sampler.py); logprobs of emitted tokens (logprobs.py)."""
