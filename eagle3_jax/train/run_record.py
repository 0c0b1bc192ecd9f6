"""Which run a training checkpoint folder belongs to, so that only the same run resumes from it.

A training run records in its checkpoint folder (`run.json`) the settings that shape its result
and a fingerprint of its data. A later run with the same checkpoint folder resumes only when both
match: a new learning rate must not silently "resume" a finished run and re-export the old weights,
and a new draft vocabulary must not meet old optimizer state of another shape. The total step
count is among the settings because the learning-rate schedule depends on it (epochs, batch size).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

RUN_FILE = "run.json"
REGENERATED_FILE = "regenerated.npz"  # the responses the run trains on, kept for a resume
BEST_DIR, BEST_FILE = "best", "best.json"  # the best measured draft's weights and figures
_CHUNK = 1 << 20


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (prompts files and corpora are small next to the training itself)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sampled_digest(path: str | os.PathLike, whole_below: int = 64 << 20, samples: int = 32) -> str:
    """sha256 of a file's bytes, or for a large one of its size and `samples` evenly spaced 64 KiB
    pieces: retrained weights differ everywhere, and hashing hundreds of GB would take longer than
    many runs."""
    size = os.path.getsize(path)
    if size <= whole_below:
        return file_digest(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(samples):
            f.seek(i * (size - (64 << 10)) // (samples - 1))
            digest.update(f.read(64 << 10))
    return digest.hexdigest()


def model_digest(folder: str | os.PathLike) -> str:
    """A fingerprint of a model folder: each file's name and `sampled_digest`."""
    folder = os.fspath(folder)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            digest.update(f"{name}:{sampled_digest(path)};".encode())
    return digest.hexdigest()


def data_fingerprint(files: Sequence[str | os.PathLike], model_folders: Sequence[str | os.PathLike] = ()) -> str:
    """One fingerprint of a run's data files (by content) and model folders (`model_digest`)."""
    parts = [file_digest(f) for f in files] + [model_digest(m) for m in model_folders]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def read_record(ckpt_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run recorded in `ckpt_dir` (None when there is none or it is unreadable)."""
    try:
        with open(os.path.join(ckpt_dir, RUN_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("settings"), dict) else None


def write_record(ckpt_dir: str | os.PathLike, settings: Mapping[str, Any], fingerprint: str, *,
                 finished: bool = False) -> None:
    """Record (atomically) the run `ckpt_dir` belongs to; `finished` once its output is written. The
    processes of a multi-host run all write the same record: each through a temporary of its own."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, RUN_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"settings": dict(settings), "data": fingerprint, "finished": finished}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def saved_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps with a complete Orbax checkpoint in `ckpt_dir` (its step folders), ascending."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(ckpt_dir, n)))


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any],
                defaults: Mapping[str, Any] | None = None) -> list[str]:
    """`name recorded -> current` for every setting that differs. A name on one side only counts as its
    entry in `defaults` there (a flag added since the record was written ran as its default), else
    as unset."""
    defaults = defaults or {}
    out = []
    for name in sorted(set(recorded) | set(current)):
        old, new = (side.get(name, defaults.get(name, "unset")) for side in (recorded, current))
        if _normal(old) != _normal(new):
            out.append(f"{name} {_shown(old)} -> {_shown(new)}")
    return out


def _normal(value: Any) -> Any:
    return json.loads(json.dumps(value))  # a tuple and the list JSON gave back are the same setting


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "''"
    return str(value)


def is_ours(ckpt_dir: str | os.PathLike) -> bool:
    """Whether `ckpt_dir` holds only what a training run writes (step folders, Orbax temporaries,
    the run record, the regenerated examples, the best measured draft), so that starting again may
    delete it."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return False
    return all(n.split(".", 1)[0].isdigit() or n.split(".", 1)[0] == BEST_DIR or n.startswith((RUN_FILE, REGENERATED_FILE))
               for n in names)
