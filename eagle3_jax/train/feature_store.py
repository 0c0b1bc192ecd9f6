"""The offline feature store: the teacher's signals over a run's packed rows, written once and streamed.

Per token it keeps the least the training needs exactly: the three feature layers and the final
hidden state in the target's dtype, the target's argmax, the token, its position and the loss mask
(`FeatureStore.bytes_per_token`); the logits over the draft vocabulary are made from the hidden
state in the loss (data.teacher_head), so one store serves any draft vocabulary.

Layout: `meta.json` plus, per shard of `shard_size` rows, one .npy per key (`shard00000.aux.npy`,
...; bfloat16 kept as uint16, its dtype named in meta.json), written into a temporary folder and
renamed into place.

Across hosts the store is one folder on the shared file system, written and read per process: the
teacher runs over the whole mesh as the online batches' does, each process writes the rows its own
devices computed (one replica of each), and in training each process reads only the rows its devices
take (`FeatureStore.batches(lazy=True)`: the rows are read when the batch is laid on the mesh).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Iterator

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from ..checkpoint.atomic import atomic_dir
from ..models.target import Target
from .data import check_ids, check_positions, check_rows, check_target, run_teacher, batch_order, row_positions
from .run_record import model_digest

STORE_FORMAT = "eagle3_jax.feature_store"
STORE_VERSION = 2  # 2: packed rows (positions), the final hidden state for the logits
STORE_KEYS = ("tokens", "loss_mask", "positions", "aux", "teacher_hidden", "teacher_argmax")
HOST_KEYS = ("tokens", "loss_mask", "positions")  # the run's own rows, written by process 0


def _storage(dtype: np.dtype) -> np.dtype:
    """How a dtype is kept in .npy: ml_dtypes types (bfloat16, ...) as unsigned ints of their width."""
    return np.dtype(f"<u{dtype.itemsize}") if dtype.kind == "V" else dtype


def _dtype_named(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _shard_file(root: str, shard: int, key: str) -> str:
    return os.path.join(root, f"shard{shard:05d}.{key}.npy")


def write_feature_store(out_dir: str | os.PathLike, target: Target, tokens, loss_mask, batch_size: int = 16,
                        progress: bool = True, *, shard_size: int = 1024, overwrite: bool = False,
                        positions=None) -> str:
    """"Offline" mode: run the teacher (data.teacher_batch) once per batch of `batch_size` rows and
    store its signals with the rows (see the module docstring); returns the store's path. In a
    multi-host run every process calls it alike (the teacher is one program over the mesh)."""
    tokens, loss_mask = check_rows(tokens, loss_mask)
    positions = check_positions(tokens, positions)
    check_target(target)
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1; got {batch_size}, {shard_size}")
    n, t = tokens.shape
    check_ids(tokens, target.config.vocab_size)
    h3 = len(target.config.aux_layer_ids) * target.config.hidden_size
    dtypes = {
        "tokens": np.dtype(np.int32), "loss_mask": np.dtype(np.bool_), "positions": np.dtype(np.int32),
        "aux": np.dtype(target.dtype), "teacher_hidden": np.dtype(target.dtype), "teacher_argmax": np.dtype(np.int32),
    }
    row_shapes = {"tokens": [t], "loss_mask": [t], "positions": [t], "aux": [t, h3],
                  "teacher_hidden": [t, target.config.hidden_size], "teacher_argmax": [t]}
    num_shards = -(-n // shard_size)
    meta = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "num_examples": n,
        "seq_len": t,
        "shard_size": shard_size,
        "num_shards": num_shards,
        "arrays": {k: {"dtype": dtypes[k].name, "storage_dtype": _storage(dtypes[k]).str, "row_shape": row_shapes[k]}
                   for k in STORE_KEYS},
        "target": model_digest(target.path) if target.path else None,
        "rows": rows_digest(tokens, positions),
        "aux_layer_ids": [int(x) for x in target.config.aux_layer_ids],
        "target_hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
        "target_dtype": np.dtype(target.dtype).name,
        "target_config": os.path.join(target.path, "config.json") if target.path else None,
    }
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but progress bars are optional
        tqdm = None
    lead = jax.process_index() == 0
    with _shared_temporary(out_dir, overwrite) as tmp:
        if lead:  # every shard's files at their full size, before any process writes its rows
            for s in range(num_shards):
                rows = min(shard_size, n - s * shard_size)
                for k in STORE_KEYS:
                    np.lib.format.open_memmap(_shard_file(tmp, s, k), mode="w+", dtype=_storage(dtypes[k]),
                                              shape=(rows, *row_shapes[k])).flush()
        _sync("feature store created")
        maps: dict[tuple[int, str], np.memmap] = {}  # (shard, key) -> open for writing
        host = {"tokens": tokens, "loss_mask": loss_mask, "positions": positions}

        def write(key: str, first: int, values: np.ndarray) -> None:
            """Rows first.. of `key` (in the store's order), across the shards they span."""
            i, values = first, values.view(_storage(dtypes[key]))
            while len(values):
                s, r = divmod(i, shard_size)
                if (s, key) not in maps:
                    maps[s, key] = np.load(_shard_file(tmp, s, key), mmap_mode="r+", allow_pickle=False)
                m = min(len(values), len(maps[s, key]) - r)
                maps[s, key][r:r + m] = values[:m]
                i, values = i + m, values[m:]

        starts = range(0, n, batch_size)
        bar = tqdm(starts, desc="teacher features", unit="batch", disable=not (progress and lead)) if tqdm else starts
        for start in bar:
            stop = min(start + batch_size, n)
            rows = np.zeros((batch_size, t), np.int32)  # pad the last batch: one compiled shape
            rows[: stop - start] = tokens[start:stop]
            at = row_positions(rows)
            at[: stop - start] = positions[start:stop]
            for key, array in run_teacher(target, rows, at).items():
                for lo, block in _own_rows(array):
                    if lo < stop - start:
                        write(key, start + lo, block[: stop - start - lo])
            if lead:
                for key in HOST_KEYS:
                    write(key, start, host[key][start:stop])
            for done in [sk for sk in maps if (sk[0] + 1) * shard_size <= stop]:  # shards below this batch are whole
                maps.pop(done).flush()
        for m in maps.values():
            m.flush()
        maps.clear()
        _sync("feature store written")
        if lead:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.write("\n")
    _sync("feature store in place")
    return os.path.abspath(os.fspath(out_dir))


def rows_digest(tokens: np.ndarray, positions: np.ndarray) -> str:
    """A fingerprint of packed rows (their tokens at their positions): what a store was written for,
    checked without reading the store's rows back."""
    digest = hashlib.sha256(f"{tokens.shape}".encode())
    for a in (tokens, positions):
        digest.update(np.ascontiguousarray(a, np.int32).tobytes())
    return digest.hexdigest()


def _own_rows(array: jax.Array) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, the rows) of each block of `array`'s rows this process holds the first replica
    of: across the processes every row once."""
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            yield shard.index[0].start or 0, np.asarray(shard.data)


def _sync(name: str) -> None:
    """Every process reaches this point before any goes on (nothing to wait for in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def _shared_temporary(out_dir: str | os.PathLike, overwrite: bool) -> Iterator[str]:
    """Process 0's temporary folder for `out_dir` (checkpoint.atomic: renamed into place when the block
    completes there), its path handed to every process."""
    if jax.process_index() == 0:
        with atomic_dir(out_dir, "feature store", overwrite=overwrite) as tmp:
            _broadcast_path(tmp)
            yield tmp
    else:
        yield _broadcast_path(None)


def _broadcast_path(path: str | None) -> str:
    """Process 0's `path`, on every process."""
    if jax.process_count() == 1:
        return path
    raw = np.zeros(4096, np.uint8)
    if path is not None:
        data = os.fsencode(path)
        raw[: len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw, is_source=jax.process_index() == 0))
    return os.fsdecode(got[got != 0].tobytes())


class FeatureStore:
    """A folder written by `write_feature_store`, read through memory maps."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        meta_path = os.path.join(self.path, "meta.json")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{self.path} is not a feature store (no meta.json); write one with write_feature_store")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path} is not valid JSON: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
            raise ValueError(f"{meta_path} is not an eagle3_jax feature store (format {STORE_FORMAT!r})")
        if meta.get("version") != STORE_VERSION:
            raise ValueError(f"{meta_path} has store version {meta.get('version')}; this code reads version {STORE_VERSION}")
        try:
            n, shard_size, num_shards = int(meta["num_examples"]), int(meta["shard_size"]), int(meta["num_shards"])
            arrays = meta["arrays"]
            self.dtypes = {k: _dtype_named(arrays[k]["dtype"]) for k in STORE_KEYS}
            storage = {k: np.dtype(arrays[k]["storage_dtype"]) for k in STORE_KEYS}
            row_shapes = {k: tuple(int(x) for x in arrays[k]["row_shape"]) for k in STORE_KEYS}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{meta_path} is malformed ({type(e).__name__}: {e}); rewrite the store") from e
        if num_shards != -(-n // shard_size):
            raise ValueError(f"{meta_path}: {num_shards} shards cannot hold {n} examples of {shard_size} per shard")
        self.meta = meta
        self._n, self._shard_size = n, shard_size
        self._maps: list[dict[str, np.ndarray]] = []
        for s in range(num_shards):
            rows = min(shard_size, n - s * shard_size)
            shard = {}
            for k in STORE_KEYS:
                f = _shard_file(self.path, s, k)
                if not os.path.isfile(f):
                    raise FileNotFoundError(f"feature store {self.path} is missing {os.path.basename(f)}; rewrite the store")
                mm = np.load(f, mmap_mode="r", allow_pickle=False)
                if mm.shape != (rows, *row_shapes[k]) or mm.dtype != storage[k]:
                    raise ValueError(f"{f} holds {mm.dtype} {mm.shape}; meta.json says {storage[k]} {(rows, *row_shapes[k])}")
                shard[k] = mm
            self._maps.append(shard)

    def __len__(self) -> int:
        return self._n

    @property
    def target(self) -> str | None:
        """The digest of the target folder that wrote it (run_record.model_digest)."""
        return self.meta.get("target")

    @property
    def rows_digest(self) -> str | None:
        """The fingerprint of the rows it was written for (`rows_digest`)."""
        return self.meta.get("rows")

    @property
    def bytes_per_token(self) -> float:
        """What the store keeps per token position (every array's row bytes over the row length)."""
        arrays = self.meta["arrays"]
        return sum(np.dtype(arrays[k]["storage_dtype"]).itemsize * int(np.prod(arrays[k]["row_shape"]))
                   for k in STORE_KEYS) / max(self.seq_len, 1)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.meta["aux_layer_ids"])

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    def row_shape(self, key: str) -> tuple[int, ...]:
        """The shape of one row of `key`."""
        return tuple(int(x) for x in self.meta["arrays"][key]["row_shape"])

    def rows(self, idx, keys: tuple[str, ...] = STORE_KEYS) -> dict[str, np.ndarray]:
        """The examples at indices `idx` (in that order), as numpy arrays of `keys`."""
        idx = np.asarray(idx, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"feature store has {self._n} examples; asked for indices in [{idx.min()}, {idx.max()}]")
        shard, row = np.divmod(idx, self._shard_size)
        out = {}
        for k in keys:
            first = self._maps[0][k] if self._maps else None
            buf = np.empty((idx.size, *(first.shape[1:] if first is not None else ())),
                           first.dtype if first is not None else self.dtypes[k])
            for s in np.unique(shard):
                sel = shard == s
                buf[sel] = self._maps[s][k][row[sel]]
            out[k] = buf.view(self.dtypes[k])
        return out

    def batches(self, batch_size: int, *, seed: int, epoch: int, drop_last: bool = True,
                lazy: bool = False) -> Iterator[dict]:
        """Batches in `batch_order(len(self), batch_size, seed=seed, epoch=epoch)` order: numpy arrays,
        or with `lazy` `StoreRows` read as the batch is laid on the devices (per process)."""
        for idx in batch_order(self._n, batch_size, seed=seed, epoch=epoch, drop_last=drop_last):
            yield {k: StoreRows(self, k, idx) for k in STORE_KEYS} if lazy else self.rows(idx)


class StoreRows:
    """Rows `idx` of one key of a store, read only when indexed: laid on a mesh
    (placement.global_array), each process reads only the rows its devices take. Behaves as the
    array it stands for (`np.asarray`)."""

    def __init__(self, store: "FeatureStore", key: str, idx: np.ndarray):
        self.store, self.key, self.idx = store, key, idx
        self.dtype = store.dtypes[key]
        self.shape = (len(idx), *store.row_shape(key))
        self._read: dict[tuple[int, int, int], np.ndarray] = {}  # devices holding the same rows read them once

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if isinstance(index[0], slice) else slice(None)
        span = rows.indices(len(self.idx))
        if span not in self._read:
            self._read[span] = self.store.rows(self.idx[slice(*span)], keys=(self.key,))[self.key]
        block = self._read[span]
        return block[(slice(None),) + index[1:]] if isinstance(index[0], slice) else block[index[0]][index[1:]]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def __len__(self) -> int:
        return len(self.idx)
