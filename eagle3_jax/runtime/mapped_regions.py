"""How many more memory mappings this process may make before Linux refuses it one.

XLA:CPU loads every kernel of an executable into memory regions of its own: a step program of the
bundled stories260K pair maps about 400, a speculative step of a larger model more. Linux refuses
a process's mappings past `vm.max_map_count` (65,530 by default), and LLVM's JIT, loading the next
program, answers the refusal by crashing the whole process (`LLVM compilation error: Cannot
allocate memory`, then a segmentation fault). A server that keeps some 150 compiled programs on
such a host is one compile away from it. `scheduler.program_cache.ProgramCache` keeps its programs
within the budget this module measures; on hosts without /proc (not Linux) there is none to keep.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

LIMIT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"
# Left to what the process maps besides compiled programs (arrays, threads' stacks, libraries).
HEADROOM_SHARE = 0.1


def map_limit(path: str = LIMIT_FILE) -> int | None:
    """vm.max_map_count, or None where the host does not say (not Linux)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def mapped_regions(path: str = MAPS_FILE) -> int:
    """The memory regions this process maps now (one line of /proc/self/maps each)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclasses.dataclass(frozen=True)
class MapBudget:
    """The regions a process may map (`limit`, less `headroom` kept for everything else) and how
    to count those it maps now (`count`, a callable so that tests can stand in for /proc)."""

    limit: int
    headroom: int
    count: Callable[[], int] = mapped_regions

    @staticmethod
    def of_this_process() -> "MapBudget | None":
        limit = map_limit()
        return None if limit is None else MapBudget(limit, int(limit * HEADROOM_SHARE))

    def room(self, regions: int | None = None) -> int:
        """Regions this process may still map, given the `regions` it maps (default: counted now)."""
        return self.limit - self.headroom - (self.count() if regions is None else regions)

    def raise_hint(self, wanted_regions: int, regions: int | None = None) -> str:
        """How to let this process, mapping `regions` (default: counted now), map `wanted_regions` more."""
        needed = ((self.count() if regions is None else regions) + wanted_regions + self.headroom) * 5 // 4
        suggested = 1 << max(needed - 1, self.limit).bit_length()
        return f"sysctl -w vm.max_map_count={suggested}"
