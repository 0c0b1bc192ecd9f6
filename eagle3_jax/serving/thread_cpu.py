"""CPU seconds of this process's threads by role, for the serving path's accounting (`/metrics`).

A server process runs the event loop (HTTP, request parsing, detokenizing and streaming replies),
the engine thread (the scheduler's host work and its waits for the device), and, on the CPU
backend, XLA's own compute threads, which run the step programs. Where they compete for few cores,
what each one costs per scheduler iteration says where a step's time goes. Threads are told apart
by their native ids (the roles the caller names) and, for XLA's, by the names XLA gives them;
every other thread counts as "other". Read from /proc (Linux); elsewhere there is nothing to read
and the result is empty.
"""

from __future__ import annotations

import os
from typing import Mapping

XLA_THREAD_PREFIXES = ("tf_", "XLA", "xla", "llvm-worker", "pjrt")


def thread_cpu_seconds(roles: Mapping[int, str]) -> dict[str, float]:
    """{role: user + system CPU seconds} of this process's live threads; a thread whose native id is in
    `roles` counts under its role, XLA's threads under "xla", the rest under "other"."""
    try:
        tids = os.listdir("/proc/self/task")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return {}
    seconds: dict[str, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        role = roles.get(int(tid)) or ("xla" if name.startswith(XLA_THREAD_PREFIXES) else "other")
        seconds[role] = seconds.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return seconds
