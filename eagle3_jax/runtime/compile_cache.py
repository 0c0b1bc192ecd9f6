"""JAX's persistent compilation cache for the server and the scripts: a restart loads the programs
an earlier run compiled instead of compiling them again (the demo server's warm-up compiles about a
hundred programs; a Kimi-K2.5 server's first request otherwise waits minutes per node).

What keys an entry is JAX's own cache key (`jax._src.cache_key.get`), a SHA-256 over:
- the program's StableHLO: every shape, dtype and sharding, and every constant folded into it, so
  another model architecture, batch bucket, block-table width, dtype, quantization, kernel choice
  (a Triton kernel is its binary in the program) or mesh layout is another program;
- the jaxlib version and the backend's platform and platform version;
- the XLA flags and the compile options (device assignment included except on GPU, where JAX leaves
  it out so the processes of a multi-host job share entries);
- the devices' kind and count, and the stored form's compression.
Weights are arguments of the programs, not constants, so a checkpoint of the same architecture and
shapes shares them, as it should. Nothing outside that key decides a program, so a stale entry is
never loaded for another run: it is simply not found, and the program compiles afresh beside it.

`enable` points JAX at a directory and says in one line, never raising, what stops it from serving
a restart: a directory it cannot create or write (compiling proceeds without the cache), one
written by another JAX version (its entries will not be found), or a disk nearly full (new
programs may not be stored). JAX itself warns and recompiles when an entry cannot be read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

OFF = "none"
MARKER = "eagle3-jax-cache.json"  # what wrote the cache last: versions and backend
LOW_DISK_BYTES = 1 << 30  # below this much free space, stored programs may not fit


def default_dir() -> str:
    """JAX's own `$JAX_COMPILATION_CACHE_DIR` where it is set, else `$XDG_CACHE_HOME/eagle3-jax/xla`,
    else `~/.cache/eagle3-jax/xla`."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "eagle3-jax", "xla")


@dataclasses.dataclass(frozen=True)
class CacheStatus:
    """Where the cache is (None: off) and how many stored programs it held when enabled."""

    directory: str | None
    entries: int = 0

    def __str__(self) -> str:
        if self.directory is None:
            return "compilation cache off: every program compiles at start"
        return f"compilation cache {self.directory} ({self.entries} stored programs)"


def _writer() -> dict:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend()}


def _count_entries(directory: str) -> int:
    return sum(1 for name in os.listdir(directory) if name != MARKER and not name.startswith("."))


def _check_writable(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
        pass


def _stale_note(directory: str, now: dict) -> str | None:
    """A line when the cache was last written by another JAX or backend (or its marker is unreadable)."""
    path = os.path.join(directory, MARKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            before = json.load(f)
        if not isinstance(before, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return f"compilation cache {directory}: its {MARKER} is unreadable ({e}); it is rewritten"
    changed = [f"{key} {before.get(key)} -> {now[key]}" for key in now if before.get(key) != now[key]]
    if not changed:
        return None
    return (f"compilation cache {directory} was written by another run ({', '.join(changed)}): its programs will "
            "not be found and compile afresh beside them (delete the folder to reclaim the space)")


def _write_marker(directory: str, now: dict) -> None:
    """Write the marker aside and rename it into place: processes starting together on one cache
    (scripts run side by side) read the old marker or the new one, never a half-written one."""
    aside = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".marker-", delete=False) as f:
            aside = f.name
            json.dump(now, f)
        os.replace(aside, os.path.join(directory, MARKER))
    except OSError:
        if aside is not None and os.path.exists(aside):
            os.unlink(aside)  # the marker only serves the stale-cache line: nothing else is lost


_status = CacheStatus(None)


def status() -> CacheStatus:
    """What the last `enable` set up (off until one is called)."""
    return _status


def enable(directory: str | None = None) -> CacheStatus:
    """Use JAX's persistent compilation cache in `directory` (None: `default_dir()`; "none" or "":
    off) for every program compiled from now on, stored however short its compile (a restart pays
    for every one). Problems are logged in one line each and leave compiling as it was."""
    global _status
    _status = _open(directory)
    return _status


def _open(directory: str | None) -> CacheStatus:
    import jax

    if directory is not None and directory.strip().lower() in (OFF, ""):
        jax.config.update("jax_compilation_cache_dir", None)
        _reset_jax_cache()
        return CacheStatus(None)
    directory = os.path.abspath(os.path.expanduser(directory or default_dir()))
    problems = []
    try:
        _check_writable(directory)
    except OSError as e:
        problem = (f"compilation cache {directory} cannot be written ({e.strerror or e}); programs compile afresh at "
                   "every start: give --compilation_cache_dir a writable folder (or none)")
        logger.warning(problem)
        return CacheStatus(None)
    now = _writer()
    stale = _stale_note(directory, now)
    if stale:
        problems.append(stale)
    free = shutil.disk_usage(directory).free
    if free < LOW_DISK_BYTES:
        problems.append(f"compilation cache {directory}: {free / 2**20:.0f} MiB free on its disk; new programs may "
                        "not be stored (free space, or point --compilation_cache_dir elsewhere)")
    for problem in problems:
        logger.warning(problem)
    _write_marker(directory, now)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_jax_cache()
    return CacheStatus(directory, _count_entries(directory))


def _reset_jax_cache() -> None:
    """JAX opens its cache once, at the first compile: reopen it at the directory just set."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
