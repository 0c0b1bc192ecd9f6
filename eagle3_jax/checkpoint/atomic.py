"""Atomic folder writes: build beside the destination, then rename into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Callable, Iterator


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike, is_ours: Callable[[str], bool], what: str) -> Iterator[str]:
    """Yield a temporary folder beside `out_dir`; on success it replaces `out_dir`.

    An existing `out_dir` is replaced only when it is empty or `is_ours(out_dir)` says it holds an
    earlier output of the same kind; anything else raises FileExistsError before writing.
    """
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            raise FileExistsError(f"{out} exists and is not a folder; choose another output path for the {what}")
        if os.listdir(out) and not is_ours(out):
            raise FileExistsError(
                f"{out} exists and does not hold a {what}; refusing to replace it (choose an empty or new folder)"
            )
    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; some writers create 0600 files
        for name in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, name)):
                os.chmod(os.path.join(tmp, name), 0o644)
        old = None
        if os.path.lexists(out):
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)  # put the previous output back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
