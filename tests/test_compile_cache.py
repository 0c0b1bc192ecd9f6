"""JAX's persistent compilation cache as the server and the scripts open it
(eagle3_jax/runtime/compile_cache.py): a second process loads what the first compiled, another dtype
is another program, and a cache that cannot serve is said in one line without stopping anything."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from eagle3_jax.runtime import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process: open the cache, compile one program, report JAX's own hit and miss counts.
RUN = """
import sys, jax, jax.numpy as jnp
from jax import monitoring
from eagle3_jax.runtime import compile_cache
counts = {"hits": 0, "misses": 0}
def listen(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
monitoring.register_event_listener(listen)
status = compile_cache.enable(sys.argv[1])
x = jnp.arange(64, dtype=sys.argv[2]).reshape(8, 8)
y = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0))(x)
print(status.entries, counts["hits"], counts["misses"], float(y.sum()))
"""


def _run(directory: str, dtype: str = "float32") -> tuple[int, int, int, float]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", RUN, directory, dtype], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    entries, hits, misses, value = out.stdout.split()
    return int(entries), int(hits), int(misses), float(value)


@pytest.fixture(autouse=True)
def _restore_jax_cache():
    """The test session's own cache (conftest) is reopened after a test that moved it."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compile_cache._reset_jax_cache()


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache = str(tmp_path / "xla")
    entries, hits, misses, first = _run(cache)
    assert (entries, hits) == (0, 0) and misses >= 1
    entries, hits, misses, second = _run(cache)
    assert entries >= 1 and hits >= 1 and misses == 0 and second == first
    # Another dtype is another program: compiled (a miss), never the float32 one loaded.
    entries_before = entries
    _, hits, misses, _ = _run(cache, "bfloat16")
    assert hits == 0 and misses >= 1
    assert len([n for n in os.listdir(cache) if n != compile_cache.MARKER]) > entries_before


def test_unreadable_entries_recompile_and_answer_the_same(tmp_path):
    cache = str(tmp_path / "xla")
    *_, first = _run(cache)
    for name in os.listdir(cache):
        if name != compile_cache.MARKER:
            with open(os.path.join(cache, name), "wb") as f:
                f.write(b"not a program")
    *_, again = _run(cache)
    assert again == first


def test_off_default_and_unwritable(tmp_path, caplog, monkeypatch):
    assert compile_cache.enable("none").directory is None and "off" in str(compile_cache.status())
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-env"))
    assert compile_cache.default_dir() == str(tmp_path / "jax-env")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    status = compile_cache.enable(None)
    assert status.directory == str(tmp_path / "home-cache" / "eagle3-jax" / "xla") and os.path.isdir(status.directory)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="eagle3_jax.runtime.compile_cache"):
        status = compile_cache.enable(str(blocker / "xla"))
    assert status.directory is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "cannot be written" in line and "--compilation_cache_dir" in line and "\n" not in line


def test_a_cache_written_by_another_jax_is_said(tmp_path, caplog):
    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / compile_cache.MARKER).write_text(json.dumps({"jax": "0.0.1", "jaxlib": "0.0.1", "backend": "cpu"}))
    with caplog.at_level(logging.WARNING, logger="eagle3_jax.runtime.compile_cache"):
        status = compile_cache.enable(str(cache))
    assert status.directory == str(cache)
    [line] = [r.getMessage() for r in caplog.records]
    assert "jax 0.0.1 ->" in line and "compile afresh" in line
    caplog.clear()
    (cache / compile_cache.MARKER).write_text("{broken")
    with caplog.at_level(logging.WARNING, logger="eagle3_jax.runtime.compile_cache"):
        compile_cache.enable(str(cache))
    assert ["unreadable" in r.getMessage() for r in caplog.records] == [True]
    assert json.loads((cache / compile_cache.MARKER).read_text())["jax"] != "0.0.1"  # rewritten


def test_the_marker_is_replaced_whole(tmp_path, monkeypatch):
    """A marker write that fails half-way leaves the previous marker as it was and nothing beside it
    (processes starting together read the old marker or the new, never a truncated one)."""
    cache = tmp_path / "xla"
    compile_cache.enable(str(cache))
    before = (cache / compile_cache.MARKER).read_text()

    def half_written(obj, f):
        f.write("{")
        raise OSError("disk full")
    monkeypatch.setattr(compile_cache.json, "dump", half_written)
    compile_cache.enable(str(cache))
    assert (cache / compile_cache.MARKER).read_text() == before
    assert not [name for name in os.listdir(cache) if name.startswith(".marker-")]
