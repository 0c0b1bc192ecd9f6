"""The host's memory allocator for a serving or benchmarking process: tcmalloc where installed.

XLA:CPU takes each run's temporaries from malloc: one preallocated block per program (36 MB for
a chain step at batch 64 and 256 slots of context) plus any large outputs. glibc hands a block
above its mmap threshold (which rises to 32 MB at most) to `mmap` and unmaps it on free, so every
step faults its temporaries in afresh, page by page, and the kernel zeroes them. In profiles of
that chain step on a 2-core host, the draft's K/V gather (16 MB) took 4.6-14 ms a step on glibc
and 2 ms on tcmalloc, which keeps freed memory for the next step. vLLM's CPU build asks for the
same preload.

The allocator is chosen when the process starts, so a script re-executes itself once with
`LD_PRELOAD` naming tcmalloc (same interpreter, arguments and process id) right after parsing its
flags, before it imports JAX, silently (a user's mistake still gets its one line). What it runs on
is said by `describe()`: serve.py's start-up lines and the benchmark records carry it.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Callable, Mapping

LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
INSTALL_HINT = "apt install libtcmalloc-minimal4 (Debian / Ubuntu) or your distribution's gperftools package"


def _preloaded_tcmalloc(environ: Mapping[str, str]) -> list[str]:
    """The file names of the tcmalloc libraries in `environ`'s LD_PRELOAD (colon or space separated)."""
    names = (os.path.basename(p) for p in environ.get("LD_PRELOAD", "").replace(":", " ").split())
    return [name for name in names if "tcmalloc" in name]


def preloaded(environ: Mapping[str, str]) -> bool:
    """Whether tcmalloc is already in `environ`'s LD_PRELOAD."""
    return bool(_preloaded_tcmalloc(environ))


def find_tcmalloc(find: Callable[[str], str | None] = ctypes.util.find_library) -> str | None:
    """tcmalloc's shared library as the loader names it (e.g. libtcmalloc_minimal.so.4), or None."""
    for name in LIBRARIES:
        found = find(name)
        if found:
            return found
    return None


def with_tcmalloc(environ: Mapping[str, str], library: str) -> dict[str, str]:
    """`environ` with `library` first in LD_PRELOAD (anything preloaded already stays after it)."""
    rest = environ.get("LD_PRELOAD", "")
    return {**environ, "LD_PRELOAD": f"{library}:{rest}" if rest else library}


def use_tcmalloc(enabled: bool) -> None:
    """Re-execute this process with tcmalloc preloaded, unless `enabled` is False, the host is not
    Linux, tcmalloc is already preloaded or not installed; returns only when it does not. Call it
    before JAX is imported (its threads and allocations would be lost with the old image)."""
    if not enabled or not sys.platform.startswith("linux") or preloaded(os.environ):
        return
    library = find_tcmalloc()
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_tcmalloc(os.environ, library))


def describe(enabled: bool = True) -> str:
    """The host allocator this process runs on, in words (and, when it is glibc's on Linux, how to
    get tcmalloc)."""
    names = _preloaded_tcmalloc(os.environ)
    if names:
        return f"tcmalloc ({names[0]})"
    if not sys.platform.startswith("linux"):
        return "the system allocator"
    if not enabled:
        return "glibc's malloc (--notcmalloc)"
    if find_tcmalloc() is not None:  # e.g. the library used from Python rather than through a script
        return "glibc's malloc (tcmalloc is installed but was not preloaded when this process started)"
    return (f"glibc's malloc: tcmalloc is not installed ({INSTALL_HINT}); XLA:CPU steps fault their large "
            "temporaries in afresh")
