"""Host arrays described, not read: each process reads only the blocks its devices hold.

A `LazyArray` is a shape, a dtype and a function that reads one block (a tuple of slices) from
the checkpoint's memory map. The loader hands them to `sharding.shard_params`, whose
`jax.make_array_from_callback` asks each process only for its own devices' blocks, so on a mesh
a process reads (and holds in host memory) only its shards: with experts split over hosts, each
host touches only its experts' pages of the files. Transposes, expert and layer stacking and dtype
casts are applied per block. `np.asarray(lazy)` reads the whole array.

`bytes_read()` counts the bytes the blocks read so far (what a test checks per process).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

_lock = threading.Lock()
_bytes_read = 0


def bytes_read() -> int:
    """Bytes materialized by LazyArray leaf reads in this process so far."""
    return _bytes_read


def _count(n: int) -> None:
    global _bytes_read
    with _lock:
        _bytes_read += n


Index = tuple[slice, ...]


class LazyArray:
    """An array of `shape` and `dtype` whose blocks `read(index)` produces on demand."""

    def __init__(self, shape: Sequence[int], dtype, read: Callable[[Index], np.ndarray]):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._read = read

    @classmethod
    def of(cls, view: np.ndarray, dtype=None, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> "LazyArray":
        """A leaf over a (memory-mapped) view; `transform` maps each block elementwise."""
        def read(index: Index) -> np.ndarray:
            block = np.array(view[index])
            _count(block.nbytes)
            return transform(block) if transform is not None else block

        return cls(view.shape, view.dtype if dtype is None else dtype, read)

    @classmethod
    def stack(cls, parts: Sequence["LazyArray | np.ndarray"]) -> "LazyArray":
        """np.stack(parts) along a new leading axis, read part by part."""
        parts = list(parts)
        first = parts[0]
        if any(tuple(p.shape) != tuple(first.shape) for p in parts):
            raise ValueError(f"cannot stack arrays of shapes {sorted({tuple(p.shape) for p in parts})}")

        def read(index: Index) -> np.ndarray:
            rest = index[1:]
            blocks = [part[rest] for part in parts[index[0]]]
            return np.stack([np.asarray(b) for b in blocks])

        return cls((len(parts),) + tuple(first.shape), first.dtype, read)

    def astype(self, dtype) -> "LazyArray":
        return LazyArray(self.shape, dtype, self._read)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) <= self.ndim and all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            full = tuple(index) + (slice(None),) * (self.ndim - len(index))
            return np.asarray(self._read(full), self.dtype)
        return np.asarray(self)[index]  # anything else: read it all, then index

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.asarray(self._read((slice(None),) * self.ndim), self.dtype)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray(shape={self.shape}, dtype={self.dtype.name})"
