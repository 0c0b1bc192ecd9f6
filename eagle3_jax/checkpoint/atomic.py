"""Safe outputs: every file or folder this project writes is checked before any work starts, built
beside its destination and swapped in only when complete.

One policy for every writer (the scripts' --out / --out_dir / --json_out, and the library's
exports, conversions and feature stores):

- An output that exists (a file, or a folder that is not empty) is refused unless `overwrite`.
- An output equal to, inside, or containing one of the run's inputs is refused even with
  `overwrite`: quantizing a model onto itself, or exporting into the folder being read, would
  destroy the input halfway through.
- A folder is never replaced by a file, and the parent must be a folder the user can write in:
  both are said before the work, naming the flag, instead of failing at the end.
- The new output is written to a hidden temporary sibling (`.<name>.tmp-<pid>-<random>`) and
  renamed into place only when complete; an existing output is first renamed aside
  (`.<name>.old-<pid>-<random>`) and deleted only once the new one is in place. An interrupted
  run therefore leaves the old output as it was; the temporary siblings a killed process could
  not remove are removed (and an output caught halfway through its swap is put back) by the next
  run that writes the same output.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Iterator, Mapping

from .errors import CheckpointError


class OutputError(CheckpointError):
    """An output path the run must not write (it exists, holds an input, cannot be written)."""


Inputs = Mapping[str, "str | os.PathLike | None"]  # how the input is named (a flag) -> its path


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _is_within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies inside it (both already real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def clash_with_input(out: str | os.PathLike, inputs: Inputs, name: str = "output") -> str | None:
    """Why `out` may not be written given the run's `inputs` (None when it may): it is an input, lies
    inside one, or contains one."""
    real_out = _real(out)
    for input_name, path in inputs.items():
        if path is None or path == "":
            continue
        real_in = _real(path)
        if real_out == real_in:
            return f"{name} {out} is the input {input_name}={path}: writing it would destroy the input; choose another {name}"
        if _is_within(real_out, real_in):
            return f"{name} {out} is inside the input {input_name}={path}; choose a {name} outside it"
        if _is_within(real_in, real_out):
            return (f"{name} {out} contains the input {input_name}={path}, which replacing it would delete; "
                    f"choose another {name}")
    return None


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _not_empty(path: str) -> bool:
    return not os.path.isdir(path) or os.path.islink(path) or bool(os.listdir(path))


def check_output(out: str | os.PathLike, *, name: str = "output", overwrite: bool = False, inputs: Inputs | None = None,
                 is_file: bool = False) -> str:
    """The absolute path of `out` when it may be written, else an OutputError saying why and what to do.

    `name` is how the user gave it (a flag such as "--out"); `inputs` are the run's inputs by name;
    `is_file` says a file (not a folder) will be written there. Cheap: call it before the work.
    """
    path = os.path.abspath(os.fspath(out))
    clash = clash_with_input(out, inputs or {}, name)
    if clash:
        raise OutputError(clash)
    if os.path.lexists(path):
        if is_file and os.path.isdir(path) and not os.path.islink(path):
            raise OutputError(f"{name} {out} is a folder; give the path of a file to write")
        if _not_empty(path) and not overwrite:
            raise OutputError(f"{name} {out} already exists; pass --overwrite to replace it (the new one is swapped "
                              f"in only once complete), or choose another {name}")
    anchor = _nearest_existing(os.path.dirname(path))
    if not os.path.isdir(anchor):
        raise OutputError(f"{name} {out}: {anchor} is a file, not a folder; choose another {name}")
    if not _can_write_in(anchor):
        raise OutputError(f"{name} {out}: cannot write in {anchor}; choose a {name} in a folder you can write to")
    return path


def _can_write_in(folder: str) -> bool:
    """Whether a file can be created in `folder`, tried for real: permission bits say nothing of a
    read-only mount, a pseudo file system (/proc) or root's rights."""
    try:
        probe = tempfile.mkdtemp(prefix=".eagle3-write-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True


# ---- the swap ---------------------------------------------------------------------------------------------


def _sibling_pattern(base: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(base)}\.(tmp|old)-(\d+)-")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def clean_leftovers(out: str | os.PathLike) -> None:
    """Remove the temporary siblings of `out` that a killed run left behind; an output moved aside
    whose replacement never arrived is put back first."""
    path = os.path.abspath(os.fspath(out))
    parent, base = os.path.split(path)
    if not os.path.isdir(parent):
        return
    pattern = _sibling_pattern(base)
    for entry in sorted(os.listdir(parent)):
        match = pattern.match(entry)
        if not match or _alive(int(match.group(2))):
            continue
        leftover = os.path.join(parent, entry)
        if match.group(1) == "old" and not os.path.lexists(path):
            os.rename(leftover, path)  # killed between moving the old output aside and the new one in
        else:
            _remove(leftover)


def _temporary_sibling(path: str, kind: str, is_file: bool) -> str:
    parent, base = os.path.split(path)
    prefix = f".{base}.{kind}-{os.getpid()}-"
    if is_file:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=parent)
        os.close(fd)
        return tmp
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def _make_readable(tmp: str, is_file: bool) -> None:
    """mkdtemp / mkstemp create 0700 / 0600; outputs get the usual 0755 folders and 0644 files."""
    if is_file:
        os.chmod(tmp, 0o644)
        return
    os.chmod(tmp, 0o755)
    for root, dirs, files in os.walk(tmp):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, f), 0o644)


def swap_in(tmp: str, path: str) -> None:
    """Rename `tmp` to `path`; an existing `path` is moved aside first and deleted only afterwards."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    if os.path.isfile(tmp) and not os.path.isdir(path):
        os.replace(tmp, path)  # atomic for files
        return
    old = _temporary_sibling(path, "old", is_file=False)
    os.rmdir(old)
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)  # put the previous output back
        raise
    _remove(old)


@contextlib.contextmanager
def atomic_output(out: str | os.PathLike, *, name: str = "output", overwrite: bool = False,
                  inputs: Inputs | None = None, is_file: bool = False) -> Iterator[str]:
    """Yield a temporary file or folder beside `out`; when the block completes it replaces `out`.

    The checks of `check_output` come first (again, if the caller made them before its work: the
    file system may have changed since). On any error or interrupt the temporary is removed and
    `out` is left as it was.
    """
    path = check_output(out, name=name, overwrite=overwrite, inputs=inputs, is_file=is_file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    clean_leftovers(path)
    tmp = _temporary_sibling(path, "tmp", is_file)
    try:
        yield tmp
        _make_readable(tmp, is_file)
        swap_in(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def atomic_dir(out_dir: str | os.PathLike, what: str = "output", *, overwrite: bool = False,
               inputs: Inputs | None = None) -> contextlib.AbstractContextManager[str]:
    """`atomic_output` for a folder (`what` names it in errors: "EAGLE-3 draft export", ...)."""
    return atomic_output(out_dir, name=what, overwrite=overwrite, inputs=inputs)


def write_text_output(out: str | os.PathLike, text: str, *, name: str = "output", overwrite: bool = False,
                      inputs: Inputs | None = None) -> str:
    """Write `text` (UTF-8) to the file `out` safely; returns its absolute path."""
    with atomic_output(out, name=name, overwrite=overwrite, inputs=inputs, is_file=True) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    return os.path.abspath(os.fspath(out))
