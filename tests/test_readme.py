"""README.md's Python examples run as written, in order, from the repository root, against the
bundled checkpoints (each block sees the names the blocks before it defined, as a reader's session
would). The default run takes the first two (plain decoding on stories260K, the EAGLE-3 pair);
the slow run takes them all (the scheduler's compiles every bucket it meets, the memory plan
compiles Kimi-K2.5's programs for 8 devices)."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return python_blocks(f.read())


def run_blocks(blocks: list[str], monkeypatch) -> dict:
    monkeypatch.chdir(ROOT)  # the examples use paths relative to the repository root
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    return namespace


def test_python_blocks_are_found():
    assert python_blocks("text\n```python\nx = 1\n```\n```bash\nls\n```\n") == ["x = 1\n"]
    blocks = readme_blocks()
    assert len(blocks) >= 4 and any("load_draft" in b for b in blocks)


def test_readme_first_examples_run(monkeypatch):
    ns = run_blocks(readme_blocks()[:2], monkeypatch)
    assert ns["outs"][0].token_ids and ns["dlogits"].shape[:2] == (1, len(ns["token_ids"][0]))
    assert ns["outs"][0].metrics["mean_accept_length"] > 1.0  # the bundled draft is accepted


@pytest.mark.slow
def test_readme_examples_run(monkeypatch):
    import jax

    if jax.device_count() < 8:
        pytest.skip("the memory-plan example needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    ns = run_blocks(readme_blocks(), monkeypatch)
    assert ns["plan"].weight_bytes > 0 and ns["sched"].stats()["num_running"] == 0
