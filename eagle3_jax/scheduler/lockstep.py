"""Multi-host serving: process 0 schedules, every other process runs the same programs in lockstep.

In a multi-host JAX job every process must launch the same sharded program with the same inputs
(each feeds its own devices). Only process 0 receives requests, so only it can decide what the
next step is. `StepChannel` carries that decision: before each step program the leader sends the
program's host inputs (a small pickled message: the program kind, the batch's rows of the slot
tables, tokens), and each follower, blocked in `follow` (`Scheduler.follow`), receives them and runs the
same program on its shards (`Leader` is the sending side, `Scheduler.lead`). The transport is `multihost_utils.broadcast_one_to_all`, a collective over every
process's devices, so messages arrive in order and nothing else is needed. Copies between the device
pool and the host tier of the prefix cache travel the same way: each process keeps its own host
copy of the pages. Payloads are padded to a
power of two so the broadcast compiles for a handful of sizes only.
"""

from __future__ import annotations

import collections
import pickle
from typing import Any

import jax
import numpy as np

_MIN_PAYLOAD = 1 << 10


def _bucket(n: int) -> int:
    size = _MIN_PAYLOAD
    while size < n:
        size *= 2
    return size


class StepChannel:
    """Broadcasts picklable messages from process 0 to every process (a collective: all must call)."""

    def __init__(self):
        self.is_leader = jax.process_index() == 0

    @staticmethod
    def _broadcast(value: np.ndarray, is_source: bool) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(value, is_source=is_source))

    def send(self, message: Any) -> None:
        """Leader: deliver `message` (None = stop) to every follower's `receive`."""
        if not self.is_leader:
            raise RuntimeError("only process 0 sends steps; the other processes call receive()")
        self._exchange(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self) -> Any:
        """Follower: the leader's next message (blocks until the leader sends it)."""
        if self.is_leader:
            raise RuntimeError("process 0 sends steps; receive() is for the other processes")
        return pickle.loads(self._exchange(b""))

    def _exchange(self, data: bytes) -> bytes:
        size = int(self._broadcast(np.asarray([len(data)], np.int32), self.is_leader)[0])
        buf = np.zeros((_bucket(size),), np.uint8)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        return self._broadcast(buf, self.is_leader)[:size].tobytes()


class Leader:
    """Process 0: tells the followers each program it launches and when it reads outputs."""

    def __init__(self):
        self.channel = StepChannel()
        if not self.channel.is_leader:
            raise RuntimeError("lead() is for process 0; the other processes call follow()")

    def launched(self, kind: str, shape, rows, args: tuple, logprobs=None, masks=None) -> None:
        self.channel.send((kind, shape, rows, jax.tree.map(np.asarray, args), logprobs, masks))

    def moved(self, method: str, *pages: list[int]) -> None:
        """The leader copies pages between the device and the host tier (`method` of the executor)."""
        self.channel.send(("move", method, pages))

    def reading(self, launches: int) -> None:
        """The leader now reads the outputs of its `launches` oldest unread programs."""
        self.channel.send(("read", launches))

    def release(self) -> None:
        """Tell every follower's `follow` to return."""
        self.channel.send(None)


def follow(executor) -> int:
    """Follower (process > 0): run the leader's programs on `executor` (a scheduler's device
    side) in the leader's order, reading outputs when it reads them, until it releases the
    followers. Returns the number of programs run."""
    channel, steps = StepChannel(), 0
    if channel.is_leader:
        raise RuntimeError("process 0 leads (lead()); follow() is for the other processes")
    unread: collections.deque = collections.deque()
    while (message := channel.receive()) is not None:
        if message[0] == "read":
            for _ in range(message[1]):
                executor.read(unread.popleft())
            continue
        if message[0] == "move":  # every process keeps its own copy of the host tier's pages
            getattr(executor, message[1])(*message[2])
            continue
        kind, shape, rows, args, logprobs, masks = message
        outputs = executor.execute(kind, shape, rows, *args, logprobs=logprobs, masks=masks)
        if outputs:  # a catch-up returns nothing to read
            unread.append(outputs)
        steps += 1
    return steps
