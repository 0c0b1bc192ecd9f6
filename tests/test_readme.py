"""README.md's Python examples run as written, in order, from the repository root, against the
bundled checkpoints (each block sees the names the blocks before it defined, as a reader's session
would). The default run takes the first two (plain decoding on stories260K, the EAGLE-3 pair);
the slow run takes them all (the scheduler's compiles every bucket it meets, the memory plan
compiles Kimi-K2.5's programs for 8 devices). The quick start keeps its two commands, and every
relative link of the README, docs/ and benchmarks/ (its page and its notes) leads to a file and
heading that exist."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return python_blocks(f.read())


def markdown_files() -> list[str]:
    """README.md, docs/*.md, benchmarks/README.md and benchmarks/notes/*.md, as paths from the root."""
    files = ["README.md", os.path.join("benchmarks", "README.md")]
    for folder in ("docs", os.path.join("benchmarks", "notes")):
        files += sorted(os.path.join(folder, f) for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".md"))
    return files


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    found = set()
    for title in re.findall(r"^#+ (.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_quick_start_keeps_two_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    quick = readme.split("## Quick start", 1)[1]
    assert re.search(r"```bash\n(.*?)```", quick, flags=re.S).group(1) == "make demo\nmake test\n"


def test_relative_links_resolve():
    assert anchors("# A `b`: c, d\n```\n# not a heading\n```\n## E-f (g)\n") == {"a-b-c-d", "e-f-g"}
    broken = []
    for path in markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for link in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", link):
                continue  # http:, https:, mailto:
            file, _, anchor = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(os.path.join(ROOT, target)):
                broken.append(f"{path}: {link} (no {target})")
            elif anchor and target.endswith(".md"):
                with open(os.path.join(ROOT, target), encoding="utf-8") as f:
                    if anchor not in anchors(f.read()):
                        broken.append(f"{path}: {link} (no heading #{anchor} in {target})")
    assert not broken, "\n".join(broken)


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


def test_readme_examples_run(monkeypatch):
    """Every Python example in the README, in order (the memory-plan one and those after it need 8
    devices, XLA_FLAGS=--xla_force_host_platform_device_count=8; without them the first two run)."""
    import jax

    whole = jax.device_count() >= 8
    ns = run_blocks(readme_blocks() if whole else readme_blocks()[:2], monkeypatch)
    assert ns["outs"][0].token_ids and ns["dlogits"].shape[:2] == (1, len(ns["token_ids"][0]))
    assert ns["outs"][0].metrics["mean_accept_length"] > 1.0  # the bundled draft is accepted
    if whole:
        assert ns["plan"].weight_bytes > 0 and ns["sched"].stats()["num_running"] == 0
