"""The scheduler's compiled step programs by shape key, within a count and the host's map budget.

Why bounded: an XLA:CPU executable maps a few memory regions per kernel (hundreds per step
program), a Linux process may map about 65k (vm.max_map_count), and past that the next compile
crashes the process (runtime/mapped_regions.py). So the cache keeps at most `capacity` programs
and, where the host has such a limit, no more than fit in it: before compiling a program it drops
the least recently used ones until the regions left hold another program of the most any compile
has mapped so far, and says once that it did. Each program is traced through its own wrapper
function, so JAX's tracing and compilation caches (keyed weakly on the function) let go of a
dropped program, and its mappings are freed.
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import jax

from ..runtime.mapped_regions import MapBudget

logger = logging.getLogger(__name__)
_OF_THIS_PROCESS = object()  # ProgramCache's default budget: the running process's


class ProgramCache:
    """Compiled step programs by shape key; beyond `capacity`, or where another program would not
    fit in `budget` (default: this process's map budget; None: no limit), the least recently used
    is dropped. `donated`: the position of the argument each program donates."""

    def __init__(self, capacity: int, donated: int, budget: MapBudget | None | object = _OF_THIS_PROCESS):
        self.capacity = capacity
        self.donated = donated
        self.budget = MapBudget.of_this_process() if budget is _OF_THIS_PROCESS else budget
        self.regions_per_program = 0  # the most regions one compile has mapped
        self.held_to: int | None = None  # the fewest programs the map budget held the cache to
        # Regions the process mapped when last counted (after the latest compile or drop): each
        # count reads /proc/self/maps, about 1 us a region (60 ms near the default limit).
        self._regions = 0
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self.num_compiles = 0
        # Host time inside the jitted calls of compiled programs: launching them (argument
        # transfers, the runtime's launch work; on a CPU device done with the caches its programs
        # evicted).
        self.launch_seconds = 0.0

    def __len__(self) -> int:
        return len(self._programs)

    @property
    def bound(self) -> int:
        """The most programs the cache holds: its capacity, or fewer where the map budget held it."""
        return self.capacity if self.held_to is None else min(self.capacity, self.held_to)

    def out_of_regions(self) -> bool:
        """Another program would not fit in the map budget without dropping one, by the count taken
        after the latest compile (the warm-up asks between its compiles)."""
        return self._lacks_room(self._regions)

    def _lacks_room(self, regions: int) -> bool:
        return bool(self.budget and self.regions_per_program and self.budget.room(regions) < self.regions_per_program)

    def run(self, fn, static: tuple, key: tuple, *args):
        """fn(*static, *args) jitted with args[donated] donated, compiled once per key.

        Keys must pin every argument's shape.
        """
        program = self._programs.get(key)
        if program is None:
            return self._compile_and_run(fn, static, key, args)
        self._programs.move_to_end(key)
        start = time.perf_counter()
        outputs = program(*args)
        self.launch_seconds += time.perf_counter() - start
        return outputs

    def _compile_and_run(self, fn, static: tuple, key: tuple, args: tuple):
        while len(self._programs) >= self.capacity:
            self._programs.popitem(last=False)
        if self.budget:
            self._regions = self.budget.count()
            if self._lacks_room(self._regions):
                self._drop_for_regions()
        program = jax.jit(functools.partial(fn, *static), donate_argnums=(self.donated,))
        self.num_compiles += 1
        self._programs[key] = program
        outputs = program(*args)  # compiles
        if self.budget:
            before, self._regions = self._regions, self.budget.count()
            self.regions_per_program = max(self.regions_per_program, self._regions - before)
        return outputs

    def _drop_for_regions(self) -> None:
        """Drop the least recently used programs until another fits in the map budget."""
        while self._programs and self._lacks_room(self._regions):
            self._programs.popitem(last=False)
            self._regions = self.budget.count()
        held = len(self._programs) + 1  # with the program about to compile
        if self.held_to is None:
            hint = self.budget.raise_hint((self.capacity - held) * self.regions_per_program, self._regions)
            logger.warning(
                "compiled programs held to %d (max_compiled_programs %d): each maps up to %d memory regions and this "
                "process may map %d (vm.max_map_count); the least recently used are dropped and compile again when "
                "next used. To keep more, raise the limit: %s", held, self.capacity, self.regions_per_program,
                self.budget.limit, hint)
        self.held_to = held if self.held_to is None else min(self.held_to, held)
