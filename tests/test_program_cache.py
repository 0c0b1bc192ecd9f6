"""The compiled-program cache within the host's memory-map budget: programs dropped least recently
used first before a compile would pass vm.max_map_count, said once; the budget read from /proc;
the warm-up stopping where no room is left."""

import logging

import jax.numpy as jnp
import pytest

from eagle3_jax.runtime.mapped_regions import MapBudget, map_limit, mapped_regions
from eagle3_jax.scheduler.program_cache import ProgramCache
from eagle3_jax.scheduler.warmup import WarmProgram, WarmUpQueue

REGIONS = 50  # what each fake program maps


class FakeProcess:
    """Regions mapped: a base plus REGIONS for each program that has compiled (been traced) and is
    still held by the cache, as XLA:CPU's executables map theirs while alive."""

    def __init__(self, base: int = 100):
        self.base, self.traced, self.cache = base, set(), None

    def count(self) -> int:
        return self.base + REGIONS * sum(1 for key in self.cache._programs if key in self.traced)

    def program(self, key):
        def fn(n, x, state):
            self.traced.add(key)
            return x * n + state
        return fn


def cache_with_room_for(programs: int, capacity: int = 10) -> tuple[ProgramCache, FakeProcess]:
    process = FakeProcess()
    budget = MapBudget(limit=process.base + REGIONS * programs + 7, headroom=7, count=process.count)
    cache = ProgramCache(capacity, donated=1, budget=budget)
    process.cache = cache
    return cache, process


def run(cache: ProgramCache, process: FakeProcess, key: int):
    return cache.run(process.program(key), (key,), key, jnp.ones(3), jnp.zeros(3))


def test_programs_past_the_map_budget_are_dropped_least_recently_used_first(caplog):
    cache, process = cache_with_room_for(4)
    for key in range(4):
        run(cache, process, key)
    assert len(cache) == 4 and cache.held_to is None and cache.out_of_regions()
    run(cache, process, 0)  # used again: the least recently used is now 1
    with caplog.at_level(logging.WARNING):
        out = run(cache, process, 4)
        run(cache, process, 5)
    assert list(out) == [4.0] * 3
    assert sorted(cache._programs) == [0, 3, 4, 5] and cache.held_to == cache.bound == 4
    assert cache.regions_per_program == REGIONS and process.count() <= cache.budget.limit - cache.budget.headroom
    said = [r.getMessage() for r in caplog.records if "vm.max_map_count" in r.getMessage()]
    assert len(said) == 1 and "held to 4 (max_compiled_programs 10)" in said[0] and "sysctl -w" in said[0]


def test_the_count_bound_holds_where_the_map_budget_has_room():
    cache, process = cache_with_room_for(100, capacity=3)
    for key in range(6):
        run(cache, process, key)
    assert sorted(cache._programs) == [3, 4, 5] and cache.held_to is None and cache.bound == 3
    assert not cache.out_of_regions() and cache.num_compiles == 6


def test_a_cache_without_a_budget_holds_its_capacity():
    process = FakeProcess()
    cache = ProgramCache(2, donated=1, budget=None)
    process.cache = cache
    for key in range(3):
        run(cache, process, key)
    assert sorted(cache._programs) == [1, 2] and not cache.out_of_regions() and cache.regions_per_program == 0


def test_the_budget_is_read_from_proc(tmp_path):
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    maps = tmp_path / "maps"
    maps.write_text("00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x\n" * 7)
    assert map_limit(str(limit)) == 65530 and map_limit(str(tmp_path / "absent")) is None
    assert mapped_regions(str(maps)) == 7
    budget = MapBudget(65530, 6553, count=lambda: 60000)
    assert budget.room() == 65530 - 6553 - 60000
    hint = budget.raise_hint(40000)
    wanted = int(hint.split("=")[1])
    assert hint.startswith("sysctl -w vm.max_map_count=") and wanted >= 60000 + 40000 + 6553
    assert wanted & (wanted - 1) == 0


@pytest.mark.skipif(map_limit() is None, reason="the host has no vm.max_map_count")
def test_this_process_has_a_budget():
    budget = MapBudget.of_this_process()
    assert budget.limit == map_limit() and 0 < budget.room() < budget.limit


def test_the_warm_up_stops_where_the_cache_has_no_room():
    wanted = [WarmProgram("decode", batch, 4) for batch in (1, 1, 2, 2, 4, 4)]
    compiled, said = [], []
    queue = WarmUpQueue(wanted, capacity=6, page_size=16, reserved=0, progress=said.append,
                        out_of_room=lambda: len(compiled) >= 3)
    report = queue.run(compiled.append)
    assert compiled == wanted[:3] and queue.finished and report.held
    assert report.programs == 3 and report.max_batch == 1
    assert "memory-map limit holds the program cache to about 3" in str(report) and str(report) in said[-1]
    queue.compile_next(compiled.append)  # a background warm-up asks again: nothing more compiles
    assert len(compiled) == 3
