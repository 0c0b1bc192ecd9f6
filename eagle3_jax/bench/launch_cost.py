"""What a launch costs on this host: the launch floors and a step's relaunch (scripts/bench_host.py).

- `launch_floors_ms`: one jitted call with the step programs' params and donated state and no
  work, warm (calls back to back) and cold (each after writing twice the last-level cache). On a
  CPU host the device's programs go through the host's caches, so every launch and all the
  scheduler's Python after a program run cache-cold: the cold floor is the least one launch costs
  there, and a launch's time above it is its program's own launch work.
- `relaunch_ms`: a step's own decode program launched again and again, each launch right after
  that program ran on an otherwise idle device: on a CPU device the least a step's launch costs,
  each step following some program's run.
"""

from __future__ import annotations

import glob
import time
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

from ..scheduler.programs import DONATED

if TYPE_CHECKING:  # annotations only
    from ..scheduler import Scheduler

DEFAULT_CACHE_BYTES = 64 << 20  # when sysfs does not say


def cache_size_bytes(text: str) -> int:
    """A sysfs cache size (`32K`, `8M`, `512`) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale


def last_level_cache_bytes(pattern: str = "/sys/devices/system/cpu/cpu0/cache/index*/size") -> int:
    """The largest CPU cache's size (Linux sysfs files matching `pattern`), else DEFAULT_CACHE_BYTES."""
    sizes = []
    for path in glob.glob(pattern):
        with open(path) as f:
            sizes.append(cache_size_bytes(f.read()))
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def copied_state(sched: Scheduler) -> Any:
    """A copy of the scheduler's device state, to donate to launches of the measurements' own."""
    return jax.block_until_ready(jax.tree.map(lambda leaf: leaf.copy(), sched._executor.state))


def median_launch_ms(launch: Callable, state: Any, repeats: int,
                     before_each: Callable[[], None] | None = None) -> tuple[float, Any]:
    """(median ms of `repeats` calls of `launch(state) -> (outputs, state)`, each after the previous
    one's outputs are ready and after `before_each()`, the state they leave). Only the call is
    timed: the wait for its outputs and `before_each` are not."""
    seconds = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        outputs, state = launch(state)
        seconds.append(time.perf_counter() - start)
        jax.block_until_ready(outputs)
    return 1e3 * float(np.median(seconds)), state


def launch_floors_ms(sched: Scheduler, repeats: int = 50) -> tuple[float, float]:
    """What a jitted call costs with the step programs' arguments and no work: a program that hands
    back a copy of the scheduler's device state (donated, as the steps donate it) over the target's
    and draft's params, launched on an idle device (median ms). A step launch's time above it is
    the program's own launch work.

    (warm, cold): calls back to back, then each call after writing a buffer twice the size of the
    last-level cache, as a CPU device's own programs do between two launches (their weights, pages
    and activations go through the host's caches): the call's code and objects are then fetched
    from memory again."""
    executor = sched._executor
    params = (executor.target.params, None if executor.draft is None else executor.draft.params)
    program = jax.jit(lambda params, state, step: (state, step + 1), donate_argnums=(1,))

    def launch(carry):  # carry: (device state, step counter)
        carry = program(params, *carry)
        return carry[1], carry

    carry = (copied_state(sched), np.zeros((), np.int32))
    for _ in range(3):  # the first calls compile
        _, carry = launch(carry)
    jax.block_until_ready(carry)
    evict = np.zeros(2 * last_level_cache_bytes() // 8)

    def evicting() -> None:
        evict[...] += 1.0

    warm, carry = median_launch_ms(launch, carry, repeats)
    cold, _ = median_launch_ms(launch, carry, repeats, before_each=evicting)
    return warm, cold


def relaunch_ms(sched: Scheduler, next_step: Callable[[], object], repeats: int = 20) -> float | None:
    """What the launch of a step's own program costs right after that program ran (median ms):
    the last program `next_step()` launches (its decode step) is captured, then launched `repeats`
    times over a copy of the device state, each after the previous one finished, with nothing
    else running. On a CPU device every launch of a step follows some program's run: this is the
    least a step's launch costs there, and against the launch floors it shows what that program
    leaves cold. None when the step launched nothing."""
    programs, captured = sched.programs, []
    run, launch = programs.run, type(programs).run  # (the class's: no phase timer around the relaunches)

    def capturing(fn, static: tuple, key: tuple, *args):
        captured[:] = [(fn, static, key, args)]
        return run(fn, static, key, *args)

    programs.run = capturing
    try:
        next_step()
    finally:
        programs.run = run
    if not captured:
        return None
    fn, static, key, args = captured[0]

    def relaunch(state):
        *outputs, state = launch(programs, fn, static, key, *args[:DONATED], state, *args[DONATED + 1:])
        return (outputs, state), state

    return median_launch_ms(relaunch, copied_state(sched), repeats)[0]
