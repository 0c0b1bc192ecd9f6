"""The KV page pool over the data shards: one allocator (and prefix cache) per shard, and the
pages of requests spread over every shard.

On a mesh with a `data` axis of D shards the pool's pages are split in D equal shares, shard d
holding pages [d * share, (d + 1) * share) (kv_cache.on_data_shards). A request of one shard takes
its pages from that shard's allocator. A spread request (context-parallel decode, cache/spread.py)
takes its logical page j from shard j mod D, so its pages, and the work of reading them, are dealt
evenly over the shards whatever its length.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ..cache.pages import PageAllocator, PrefixCache

SPREAD = -1  # the shard of a request spread over every data shard


class ShardPages:
    """`shards` page allocators over a pool of `num_pages` pages (see the module doc). Requests of
    `spread_len` tokens or more (prompt + max tokens) are spread (None: never)."""

    def __init__(self, num_pages: int, shards: int, prefix_caching: bool, spread_len: int | None):
        self.shards, self.share = shards, num_pages // shards
        self.allocs = [PageAllocator(self.share, first_page=d * self.share) for d in range(shards)]
        for alloc in self.allocs if prefix_caching else ():
            alloc.cache = PrefixCache()
        self.spread_len = spread_len if shards > 1 else None

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
            return self.allocs[shard].allocate(n)
        dealt = [iter(a.allocate(int(c))) for a, c in zip(self.allocs, self.spread_counts(start, n))]
        return [next(dealt[j % self.shards]) for j in range(start, start + n)]

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
        """Pages of every shard together: usable, free, cached."""
        return {"num_pages": sum(a.num_usable for a in self.allocs), "num_free_pages": sum(a.num_free for a in self.allocs),
                "num_cached_pages": sum(a.cache.num_cached for a in self.allocs if a.cache is not None)}
