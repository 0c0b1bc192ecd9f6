"""The KV page pool over the data shards: one allocator (and prefix cache) per shard, and the
pages of requests spread over every shard.

On a mesh with a `data` axis of D shards the pool's pages are split in D equal shares, shard d
holding pages [d * share, (d + 1) * share) (kv_cache.on_data_shards). A request of one shard takes
its pages from that shard's allocator. A spread request (context-parallel decode, cache/spread.py)
takes its logical page j from shard j mod D, so its pages, and the work of reading them, are dealt
evenly over the shards whatever its length.

With a host tier (cache/host_tier.py) each shard also has its share of the host slots: the pages
its prefix cache evicts are copied there as they are evicted (`allocate` hands them to the
`HostMover` before anyone can write them again), and `take_prefix` copies a prefix's host pages
back into pages it allocates.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol, Sequence

import numpy as np

from ..cache.host_tier import HostPageIndex
from ..cache.pages import PageAllocator, PageKey, PrefixCache

SPREAD = -1  # the shard of a request spread over every data shard


class HostMover(Protocol):
    """Copies pages between the device pool and the host tier's slots (scheduler/launches.py)."""

    def save_pages(self, pages: list[int], slots: list[int]) -> None: ...

    def restore_pages(self, slots: list[int], pages: list[int]) -> None: ...


@dataclasses.dataclass
class CachedPrefix:
    """The cached pages of a prompt's longest cached prefix, one per full page: its device page,
    or None where the host tier holds it (in `host_slots`, draft-valid per `host_draft`)."""

    pages: list[int | None] = dataclasses.field(default_factory=list)
    host_slots: list[int] = dataclasses.field(default_factory=list)
    host_draft: list[bool] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def on_device(self) -> list[int]:
        return [p for p in self.pages if p is not None]


class ShardPages:
    """`shards` page allocators over a pool of `num_pages` pages (see the module doc). Requests of
    `spread_len` tokens or more (prompt + max tokens) are spread (None: never)."""

    def __init__(self, num_pages: int, shards: int, prefix_caching: bool, spread_len: int | None):
        self.shards, self.share = shards, num_pages // shards
        self.allocs = [PageAllocator(self.share, first_page=d * self.share) for d in range(shards)]
        for alloc in self.allocs if prefix_caching else ():
            alloc.cache = PrefixCache()
        self.spread_len = spread_len if shards > 1 else None
        self.host: list[HostPageIndex] | None = None
        self.mover: HostMover | None = None

    def attach_host_tier(self, slots_per_shard: int, mover: HostMover) -> None:
        """Keep what the prefix caches evict in `slots_per_shard` host slots per shard, copied by `mover`."""
        self.host = [HostPageIndex(d * slots_per_shard, slots_per_shard) for d in range(self.shards)]
        self.mover = mover
        for alloc in self.allocs:
            alloc.cache.evicted = []

    def lookup(self, shard: int, keys: Sequence[PageKey], with_draft: bool) -> CachedPrefix:
        """The longest prefix of `keys` cached on `shard`, page by page on the device or the host
        (draft-valid pages if `with_draft`)."""
        cache, prefix = self.allocs[shard].cache, CachedPrefix()
        host = self.host[shard] if self.host is not None else None
        for key in keys:
            page = cache.find(key, with_draft)
            slot = host.lookup(key, with_draft) if page is None and host is not None else None
            if page is None and slot is None:
                break
            prefix.pages.append(page)
            if slot is not None:
                prefix.host_slots.append(slot)
                prefix.host_draft.append(with_draft or host.lookup(key, True) is not None)
        return prefix

    def take_prefix(self, shard: int, prefix: CachedPrefix, keys: Sequence[PageKey]) -> list[int]:
        """A request's pages for `prefix`, whose device pages it holds already: those, and pages
        allocated for the host's, filled by copy and cached under their keys."""
        if not prefix.host_slots:
            return list(prefix.pages)
        index = self.host[shard]
        index.pinned.update(prefix.host_slots)  # what this allocation evicts must not land on them
        try:
            restored = self.allocate(shard, 0, len(prefix.host_slots))
        finally:
            index.pinned.clear()
        self.mover.restore_pages(prefix.host_slots, restored)
        fill, cache = iter(zip(restored, prefix.host_draft)), self.allocs[shard].cache
        pages = []
        for key, page in zip(keys, prefix.pages):
            if page is None:
                page, draft_valid = next(fill)
                cache.register(key, page, draft_valid)
            pages.append(page)
        return pages

    def spreads(self, tokens: int) -> bool:
        """Whether a request of `tokens` (prompt + max tokens) is spread over every shard."""
        return self.spread_len is not None and tokens >= self.spread_len

    def per_shard(self, shards: Iterable[int]) -> np.ndarray:
        """[D] how many of the requests on `shards` each shard holds (a spread one: every shard)."""
        shards = list(shards)
        return np.bincount([d for d in shards if d != SPREAD], minlength=self.shards) + shards.count(SPREAD)

    def spread_counts(self, start: int, n: int) -> np.ndarray:
        """[D] how many of a spread request's logical pages start .. start + n - 1 each shard holds."""
        return np.bincount(np.arange(start, start + max(n, 0)) % self.shards, minlength=self.shards)

    def fits_spread(self, pages: int, reserve: np.ndarray) -> bool:
        """Whether a spread request's first `pages` fit beside `reserve` [D] pages on every shard."""
        need = self.spread_counts(0, pages) + reserve
        return all(n <= a.num_free for n, a in zip(need, self.allocs))

    def allocate(self, shard: int, start: int, n: int) -> list[int]:
        """`n` more pages for a request on `shard` holding `start` pages (a spread one's dealt)."""
        if shard != SPREAD:
            pages = self.allocs[shard].allocate(n)
            self._spill(shard)
            return pages
        dealt = [iter(a.allocate(int(c))) for a, c in zip(self.allocs, self.spread_counts(start, n))]
        for d in range(self.shards):
            self._spill(d)
        return [next(dealt[j % self.shards]) for j in range(start, start + n)]

    def _spill(self, shard: int) -> None:
        """Copy the pages `shard`'s prefix cache just evicted to its host slots."""
        evicted = self.allocs[shard].cache.evicted if self.host is not None else None
        if evicted:
            pages, slots = self.host[shard].spill(evicted)
            evicted.clear()
            if pages:
                self.mover.save_pages(pages, slots)

    def reset_cache(self) -> None:
        """Forget every cached page, on the device and the host."""
        for alloc in self.allocs:
            alloc.reset_cache()
        for index in self.host or ():
            index.forget_all()

    def free(self, shard: int, pages: list[int]) -> None:
        """Give back a request's pages (a spread one's to the shard holding each)."""
        if shard != SPREAD:
            self.allocs[shard].free(pages)
            return
        for d, alloc in enumerate(self.allocs):
            alloc.free([p for p in pages if p // self.share == d])

    def short(self, shard: int, start: int, need: int) -> int | None:
        """A shard without the free pages that `need` more pages of a request on `shard` holding
        `start` pages take of it; None when every shard has them."""
        if shard != SPREAD:
            return shard if need > self.allocs[shard].num_free else None
        counts = self.spread_counts(start, need)
        return next((d for d, a in enumerate(self.allocs) if counts[d] > a.num_free), None)

    def num_usable(self, tokens: int) -> int:
        """Pages a request of `tokens` may hold at most: every shard's when spread, else one shard's."""
        return self.allocs[0].num_usable * (self.shards if self.spreads(tokens) else 1)

    def counts(self) -> dict[str, int]:
        """Pages of every shard together: usable, free, cached (and the host tier's slots, cached ones)."""
        counts = {"num_pages": sum(a.num_usable for a in self.allocs), "num_free_pages": sum(a.num_free for a in self.allocs),
                  "num_cached_pages": sum(a.cache.num_cached for a in self.allocs if a.cache is not None)}
        if self.host is not None:
            counts.update(num_host_pages=sum(h.num_slots for h in self.host),
                          num_host_cached_pages=sum(h.num_cached for h in self.host))
        return counts
