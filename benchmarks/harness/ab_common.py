"""What the recorded A/B scripts beside this file share: the demo pair with its prompts, and a
module attribute swapped for the length of a `with` block (run them from the repository root)."""
import contextlib

import eagle3_jax as e3
from eagle3_jax.tokenizer import load_tokenizer


def demo_pair():
    """(kimi-mini target, its EAGLE-3 draft, the demo prompts' token ids), float32."""
    target = e3.load_target("checkpoints/kimi-mini", dtype="float32")
    draft = e3.load_draft("checkpoints/kimi-mini-eagle3", target=target, dtype="float32")
    tok = load_tokenizer("checkpoints/kimi-mini")
    with open("checkpoints/demo_prompts.txt") as f:
        prompts = [tok.encode(line.strip()) for line in f if line.strip()]
    return target, draft, prompts


@contextlib.contextmanager
def swapped(module, name: str, value):
    """`module.name` is `value` inside the block, its own value again after it."""
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)
