"""Host-side allocator of KV-cache pages (fixed-size blocks of cache slots), with a prefix cache.

Page 0 is never handed out: it is the scratch page that unassigned block-table entries point at
(see kv_cache.py). Free pages are kept LIFO, so a freed page is reused first while it is still
warm in the device's caches.

Pages are reference-counted: several requests may hold one page (a prefix they share). With the
prefix cache on, a full page whose contents are final can be registered under a key that names
everything it was computed from (`PrefixCache`); when its last holder frees it, it stays cached,
evictable, and a request whose tokens give the same key takes it instead of computing it again.
Cached pages are evicted least recently used, only when no page is free.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence


def pages_for(num_slots: int, page_size: int) -> int:
    """Pages needed to hold `num_slots` cache slots."""
    return -(-num_slots // page_size)


class PageAllocator:
    """Reference-counted pages first_page + 1 .. first_page + num_pages - 1 (a data shard's share
    of the pool starts at its own first page, which it never hands out either): free ones, held
    ones and (with a PrefixCache) cached ones that nobody holds."""

    def __init__(self, num_pages: int, first_page: int = 0):
        if num_pages < 2:
            raise ValueError(f"a paged KV cache needs at least 2 pages (one is reserved); got {num_pages}")
        self.num_pages = int(num_pages)
        self._free = list(range(first_page + self.num_pages - 1, first_page, -1))
        self._refs: dict[int, int] = {}  # held pages -> holders
        self.cache: PrefixCache | None = None

    @property
    def num_usable(self) -> int:
        """Pages that can be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now: free, or cached and held by nobody (evictable)."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_held(self) -> int:
        return len(self._refs)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int]:
        """`n` distinct pages nobody holds, free ones first, then the least recently used cached
        ones (evicted from the cache); raises MemoryError (taking none) when fewer are available."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV pages with {self.num_free} free")
        pages = []
        for _ in range(n):
            page = self._free.pop() if self._free else self.cache.evict()
            self._refs[page] = 1
            pages.append(page)
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        """One more holder for each of `pages` (cached pages taken by a request)."""
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            else:
                self.cache.take(p)  # nobody held it: it leaves the evictable set
                self._refs[p] = 1

    def reset_cache(self) -> None:
        """Forget every cached page: those nobody holds go back to the free list, held ones are
        freed as uncached pages when their holders let go."""
        if self.cache is not None:
            self._free.extend(self.cache.forget_all())

    def free(self, pages: Sequence[int]) -> None:
        """Drop one holder of each page; a page nobody holds any more goes back to the free list,
        or stays cached (evictable) if the prefix cache has it. Freeing a page that is not held is
        a bug, so it raises."""
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"KV page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                if self.cache is not None and self.cache.has(p):
                    self.cache.release(p)
                else:
                    self._free.append(p)


PageKey = bytes


def page_keys(tokens: Sequence[int], page_size: int, num_pages: int, known: Sequence[PageKey] = ()) -> list[PageKey]:
    """Keys of the first `num_pages` full pages of a token sequence, each naming everything the
    page's K/V depends on: every token up to the page's end and, for the draft's slots (slot t
    pairs the target feature at t with token t + 1), the token after it (so `tokens` must hold
    num_pages * page_size + 1 tokens). Chained: a page's key hashes its parent's key. `known`: the
    keys of the first pages, computed before (only the rest are hashed)."""
    keys = list(known[:num_pages])
    parent = keys[-1] if keys else hashlib.blake2b(b"", digest_size=16).digest()
    for i in range(len(keys), num_pages):
        chunk = tokens[i * page_size: (i + 1) * page_size + 1]
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk))
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass
class _Entry:
    page: int
    draft_valid: bool  # the page's draft K/V slots were written too (a request with the draft)


class PrefixCache:
    """Full pages by key (`page_keys`), and the cached pages nobody holds, least recently used first.

    A page is registered only once all it holds is final: target K/V of its tokens and, when
    `draft_valid`, the draft's K/V of the pairs (feature t, token t + 1) of its slots. A request
    that runs the draft may take only draft-valid pages; one block table indexes both pools, so a
    page serves both or neither.
    """

    def __init__(self):
        self._by_key: dict[PageKey, _Entry] = {}
        self._key_of: dict[int, PageKey] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        # With a host tier (host_tier.py): (key, page, draft_valid) of the pages evicted since the
        # tier last took them, to be copied before anything writes them again.
        self.evicted: list[tuple[PageKey, int, bool]] | None = None

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def has(self, page: int) -> bool:
        return page in self._key_of

    def find(self, key: PageKey, with_draft: bool) -> int | None:
        """The cached page of `key` (a draft-valid one if `with_draft`), or None."""
        entry = self._by_key.get(key)
        return None if entry is None or (with_draft and not entry.draft_valid) else entry.page

    def lookup(self, keys: Sequence[PageKey], with_draft: bool) -> list[int]:
        """The cached pages of the longest prefix of `keys` (draft-valid ones if `with_draft`)."""
        pages = []
        for key in keys:
            page = self.find(key, with_draft)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, key: PageKey, page: int, draft_valid: bool) -> None:
        """Cache a held page under `key`. A key cached already keeps its page (an upgrade to
        draft-valid is recorded on it only if it is this page); a page cached already keeps its key."""
        entry = self._by_key.get(key)
        if entry is not None:
            if entry.page == page:
                entry.draft_valid |= draft_valid
            return
        if page in self._key_of:
            return
        self._by_key[key] = _Entry(page, draft_valid)
        self._key_of[page] = key

    def take(self, page: int) -> None:
        """A cached page nobody held is held again."""
        del self._evictable[page]

    def release(self, page: int) -> None:
        """A cached page's last holder freed it: it becomes evictable, most recently used."""
        self._evictable[page] = None

    def forget_all(self) -> list[int]:
        """Empty the cache; returns the pages that were evictable (nobody holds them)."""
        evictable = list(self._evictable)
        self._by_key.clear()
        self._key_of.clear()
        self._evictable.clear()
        return evictable

    def evict(self) -> int:
        """The least recently used evictable page, forgotten by the cache."""
        page, _ = self._evictable.popitem(last=False)
        key = self._key_of.pop(page)
        entry = self._by_key.pop(key)
        if self.evicted is not None:
            self.evicted.append((key, page, entry.draft_valid))
        return page
