"""Host-side allocator of KV-cache pages (fixed-size blocks of cache slots).

Page 0 is never handed out: it is the scratch page that unassigned block-table entries point at
(see kv_cache.py). Pages are returned to a LIFO free list, so a freed page is reused first while
it is still warm in the device's caches.
"""

from __future__ import annotations


def pages_for(num_slots: int, page_size: int) -> int:
    """Pages needed to hold `num_slots` cache slots."""
    return -(-num_slots // page_size)


class PageAllocator:
    """Free list over pages 1 .. num_pages - 1."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a paged KV cache needs at least 2 pages (one is reserved); got {num_pages}")
        self.num_pages = int(num_pages)
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_usable(self) -> int:
        """Pages that can be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` distinct free pages; raises MemoryError (taking none) when fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages with {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the free list; freeing a page that is not in use is a bug, so it raises."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"KV page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)
