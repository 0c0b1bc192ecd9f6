"""A host-memory tier for the prefix cache: pages the device pool evicts keep their K/V on the host.

An agent session's context leaves the device pool while its tool runs and other sessions decode;
without a second tier its return computes every token again. With one, a cached page that the
device pool evicts (cache.pages.PrefixCache, least recently used) is copied, target and draft K/V
(FP8 pages as they are, scales included), into a bounded pool of host pages under the same key;
a request whose prefix is found there gets fresh device pages filled by copy instead of prefill.

Two halves, because on a multi-host run only process 0 schedules while every process holds its own
copy of the bytes (scheduler/lockstep.py):
- `HostPageIndex`: the bookkeeping (scheduler side, one per data shard): which key sits in which
  host slot, draft-valid or not, least recently used first. A slot being restored is pinned, so
  that pages evicted by the same admission never overwrite it.
- `HostPagePool`: the bytes (device side, every process): numpy arrays shaped like the device
  pools with host slots for pages. A save gathers the evicted pages into one device array, starts
  its copy to the host (`copy_to_host_async`) and writes it into its slots only at the next save
  or restore, so the copy runs behind the steps launched meanwhile; a restore reads its slots
  and hands them to the program that writes them into the device pool.

The host pages are plain host (numpy) arrays on every backend: JAX's `pinned_host` memory kind
would save a staging copy on a GPU, but a bounded pool written a page at a time by slot needs host
writes that its arrays do not allow.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .pages import PageKey

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclasses.dataclass
class _HostEntry:
    slot: int
    draft_valid: bool


class HostPageIndex:
    """Keys of the pages held in host slots first_slot .. first_slot + num_slots - 1."""

    def __init__(self, first_slot: int, num_slots: int):
        self.num_slots = int(num_slots)
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._by_key: collections.OrderedDict[PageKey, _HostEntry] = collections.OrderedDict()  # LRU first
        self.pinned: set[int] = set()

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    def lookup(self, key: PageKey, with_draft: bool) -> int | None:
        """The host slot holding `key` (draft-valid if `with_draft`), now most recently used."""
        entry = self._by_key.get(key)
        if entry is None or (with_draft and not entry.draft_valid):
            return None
        self._by_key.move_to_end(key)
        return entry.slot

    def spill(self, evicted: Sequence[tuple[PageKey, int, bool]]) -> tuple[list[int], list[int]]:
        """Take the (key, device page, draft_valid) pages the device pool evicted: returns the
        (device pages, host slots) to copy. A key held already is copied again only to become
        draft-valid; room is made by dropping the least recently used unpinned keys, and a page
        that finds none is dropped instead."""
        pages, slots = [], []
        for key, page, draft_valid in evicted:
            entry = self._by_key.get(key)
            if entry is not None:
                self._by_key.move_to_end(key)
                if entry.draft_valid or not draft_valid:
                    continue
                entry.draft_valid = True
            else:
                slot = self._free_slot()
                if slot is None:
                    continue
                entry = self._by_key[key] = _HostEntry(slot, draft_valid)
            pages.append(page)
            slots.append(entry.slot)
        return pages, slots

    def _free_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((k for k, e in self._by_key.items() if e.slot not in self.pinned), None)
        return None if victim is None else self._by_key.pop(victim).slot

    def forget_all(self) -> None:
        self._free.extend(e.slot for e in self._by_key.values())
        self._by_key.clear()


def page_bytes(pools) -> int:
    """Bytes one page takes in `pools` (device page pools [L, pages, page_size, ...], any pytree)."""
    return sum(leaf.dtype.itemsize * leaf.size // leaf.shape[1] for leaf in jax.tree.leaves(pools))


def available_host_bytes() -> int | None:
    """The memory this machine has available now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_slots_for(gib: float, bytes_per_page: int, available: int | None) -> int:
    """Host slots that `gib` GiB hold, at most what may fit in `available` bytes (less a quarter
    of them, kept for everything else), said in a warning when that caps it."""
    if gib < 0:
        raise ValueError(f"host_kv_cache_gb must be >= 0; got {gib}")
    wanted = int(gib * GIB)
    if available is not None and wanted > 0.75 * available:
        capped = int(0.75 * available)
        logger.warning("host_kv_cache_gb=%g is more than this machine has available (%.1f GiB); the host KV tier "
                       "holds %.1f GiB instead", gib, available / GIB, capped / GIB)
        wanted = capped
    return wanted // bytes_per_page


def _bucket(n: int) -> int:
    """Pages per copy program: a power of two, so a few programs serve every count."""
    return 1 << max(n - 1, 1).bit_length()


def _gather(pools, pages):
    return [leaf[:, pages] for leaf in jax.tree.leaves(pools)]


def _scatter(pools, pages, pages_data):
    leaves, tree = jax.tree.flatten(pools)
    return jax.tree.unflatten(tree, [leaf.at[:, pages].set(data) for leaf, data in zip(leaves, pages_data)])


class HostPagePool:
    """`num_slots` host pages shaped like the device `pools` (see the module doc); one more slot,
    the last, is scratch for padding."""

    def __init__(self, pools, num_slots: int):
        self.num_slots = int(num_slots)
        self.scratch = self.num_slots
        self._arrays = [np.zeros((leaf.shape[0], self.num_slots + 1) + leaf.shape[2:], leaf.dtype)
                        for leaf in jax.tree.leaves(pools)]
        self.bytes_per_page = page_bytes(pools)
        self._pending: list[tuple[np.ndarray, list[jax.Array]]] = []  # (slots, gathered pages) not written yet
        self._scatter = jax.jit(_scatter, donate_argnums=(0,))
        # Pools over several processes: the pages are gathered whole onto every device (each
        # process copies its own), and a restore's host pages go in whole from every process.
        first = jax.tree.leaves(pools)[0]
        self._whole = None if first.is_fully_addressable else NamedSharding(first.sharding.mesh, PartitionSpec())
        self._gather = jax.jit(_gather) if self._whole is None else jax.jit(_gather, out_shardings=self._whole)

    def save(self, pools, pages: Sequence[int], slots: Sequence[int], scratch_page: int = 0) -> None:
        """Copy device `pages` of `pools` into host `slots` (written later, see the module doc)."""
        self.flush()
        n = _bucket(len(pages))
        padded = np.full((n,), scratch_page, np.int32)
        padded[: len(pages)] = pages
        gathered = self._gather(pools, padded)
        for array in gathered:
            if array.is_fully_addressable:
                array.copy_to_host_async()
        self._pending.append((np.asarray(slots, np.int64), gathered))

    def flush(self) -> None:
        """Write the saved pages into their slots (waiting for their copies)."""
        for slots, gathered in self._pending:
            for host, array in zip(self._arrays, gathered):
                host[:, slots] = _host_value(array)[:, : len(slots)]
        self._pending.clear()

    def restore(self, pools, slots: Sequence[int], pages: Sequence[int], scratch_page: int = 0):
        """`pools` with device `pages` holding host `slots`' K/V (`pools` donated)."""
        self.flush()
        n = _bucket(len(pages))
        padded_slots = np.full((n,), self.scratch, np.int64)
        padded_slots[: len(slots)] = slots
        padded_pages = np.full((n,), scratch_page, np.int32)
        padded_pages[: len(pages)] = pages
        pages_data = [host[:, padded_slots] for host in self._arrays]
        if self._whole is not None:
            pages_data = [jax.device_put(data, self._whole) for data in pages_data]
        return self._scatter(pools, padded_pages, pages_data)


def _host_value(array: jax.Array) -> np.ndarray:
    """A gathered array's value on this process: its own device's copy when it spans other
    processes (gathered whole onto every device), else the array."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(array.addressable_data(0))
