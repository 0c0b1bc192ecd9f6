"""Lazy reading of HF safetensors checkpoints (single file, sharded with an index, or a folder of
shards), straight from the file format.

We parse the format ourselves (8-byte little-endian header length, JSON header, raw buffer) and
view tensors through `np.memmap`, because safetensors' numpy loader cannot represent bfloat16 or
float8 while `ml_dtypes` can, and because memory-mapping reads only the bytes a tensor occupies:
a 550 GB checkpoint is never resident at once. Pickled PyTorch weights are refused, never loaded.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "pytorch_model.bin.index.json")
_MAX_HEADER_BYTES = 512 * 1024 * 1024

# safetensors dtype tag -> numpy dtype (bf16 / fp8 through ml_dtypes). Little-endian, as the
# format prescribes (numpy's native order on every platform this project targets).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Header entry of one tensor: enough to validate a checkpoint without reading data."""

    key: str
    dtype_tag: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    file: str
    begin: int  # absolute byte offsets in `file`
    end: int

    @property
    def dtype(self) -> np.dtype:
        if self.dtype_tag not in _DTYPES:
            raise CheckpointError(
                f"tensor {self.key!r} in {self.file} has safetensors dtype {self.dtype_tag!r}, which this "
                f"reader does not support (supported: {', '.join(_DTYPES)})"
            )
        return _DTYPES[self.dtype_tag]


class SafetensorsFile:
    """One .safetensors file: the parsed header plus a lazily created read-only memory map."""

    def __init__(self, path: str):
        self.path = path
        self.infos = _parse_header(path)
        self._mmap: np.memmap | None = None

    def read(self, key: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in the memory map (copy before keeping it)."""
        info = self.infos[key]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[info.begin : info.end]
        return raw.view(info.dtype).reshape(info.shape)


def _parse_header(path: str) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header; every offset must lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes); re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(f"{path} has a corrupt safetensors header (length {n}); re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({e}); re-download it") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object); re-download it")
    base = 8 + n
    infos: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            tag = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for tensor {key!r} ({e}); re-download it") from e
        info = TensorInfo(key, tag, shape, path, base + begin, base + end)
        if tag in _DTYPES:
            want = int(np.prod(shape, dtype=np.int64)) * _DTYPES[tag].itemsize
            if end - begin != want:
                raise CheckpointError(
                    f"{path}: tensor {key!r} ({tag} {list(shape)}) occupies {end - begin} bytes, expected {want}; "
                    "the file is corrupt, re-download it"
                )
        if not 0 <= begin <= end or info.end > size:
            raise CheckpointError(
                f"{path}: tensor {key!r} lies outside the file (bytes {begin}..{end} of {size - base}); "
                "the file is truncated, re-download it"
            )
        infos[key] = info
    return infos


class HFCheckpoint:
    """All tensors of an HF checkpoint folder, addressed by key, read lazily."""

    def __init__(self, folder: str, key_to_file: dict[str, str]):
        self.folder = folder
        self._files: dict[str, SafetensorsFile] = {}
        self.infos: dict[str, TensorInfo] = {}
        for fname in sorted(set(key_to_file.values())):
            self._files[fname] = SafetensorsFile(os.path.join(folder, fname))
        for key, fname in key_to_file.items():
            sf = self._files[fname]
            if key not in sf.infos:
                raise CheckpointError(
                    f"{INDEX_NAME} in {folder} says tensor {key!r} is in {fname}, but that file does not "
                    "contain it; the index and the shards are out of sync, re-download the checkpoint"
                )
            self.infos[key] = sf.infos[key]

    def keys(self) -> Iterable[str]:
        return self.infos.keys()

    def read(self, key: str) -> np.ndarray:
        """Read-only view of one tensor (memory-mapped; copy it to keep it)."""
        return self._files[os.path.basename(self.infos[key].file)].read(key)


def find_pickles(folder: str) -> list[str]:
    found: set[str] = set()
    for pat in PICKLE_PATTERNS:
        found.update(os.path.basename(p) for p in glob.glob(os.path.join(folder, pat)))
    return sorted(found)


def open_hf_checkpoint(folder: str | os.PathLike) -> HFCheckpoint:
    """Open an HF folder: `model.safetensors.index.json` (sharded), `model.safetensors`, or any
    `*.safetensors` files. Refuses pickle-only folders; a shard the index names must exist."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} does not exist (or is not a folder); pass an HF model folder")
    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        return HFCheckpoint(folder, _read_index(folder, index_path))
    if os.path.isfile(os.path.join(folder, SINGLE_NAME)):
        sf = SafetensorsFile(os.path.join(folder, SINGLE_NAME))
        return HFCheckpoint(folder, {k: SINGLE_NAME for k in sf.infos})
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
    if shards:
        key_to_file: dict[str, str] = {}
        for fname in shards:
            for key in SafetensorsFile(os.path.join(folder, fname)).infos:
                if key in key_to_file:
                    raise CheckpointError(
                        f"tensor {key!r} appears in both {key_to_file[key]} and {fname} in {folder}, and there is "
                        f"no {INDEX_NAME} saying which is current; remove the stale file"
                    )
                key_to_file[key] = fname
        return HFCheckpoint(folder, key_to_file)
    pickles = find_pickles(folder)
    if pickles:
        raise CheckpointError(
            f"{folder} holds only PyTorch pickle weights ({', '.join(pickles)}); this project never loads pickles "
            "(they can run arbitrary code). Convert them to safetensors in an environment you trust, e.g. "
            "`AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)`, "
            "and pass the new folder"
        )
    raise CheckpointError(f"no *.safetensors files or {INDEX_NAME} in {folder}; pass an HF model folder with safetensors weights")


def _read_index(folder: str, index_path: str) -> dict[str, str]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path} is not a valid safetensors index (needs a 'weight_map' object): {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has an empty or malformed 'weight_map'; re-download the checkpoint")
    missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(folder, f))})
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(
            f"shard file(s) {shown} named in {index_path} are missing from {folder}; "
            "download the missing shard(s) (e.g. `huggingface-cli download <repo> <file> --local-dir <folder>`)"
        )
    return {str(k): str(v) for k, v in weight_map.items()}
