"""Where a serving step's time goes, per scheduler iteration, from two /metrics scrapes of a server
(scripts/serve.py) around a benchmark cell and the client's own CPU time over it.

Per iteration (`eagle3_scheduler_iterations_total` between the scrapes), in milliseconds:

- `wall`: the cell's duration;
- `engine_step`: the engine thread inside `Scheduler.step()`, split into `scheduler_host` (its host
  work, launches included) and `device_wait` (waiting for the step programs' results);
- `deliver`: the engine thread handing outputs to the requests' event loops;
- `cpu`: CPU time by thread role (`event_loop`: HTTP, detokenizing and streaming; `engine`; `xla`:
  XLA's compute threads, which run the programs on the CPU backend; `other`) and the benchmark
  `client`'s; on a host with few cores these compete, so their sum against `wall` x cores says how
  busy the host was.
"""

from __future__ import annotations

from typing import Mapping

ITERATIONS = "eagle3_scheduler_iterations_total"
CPU = "eagle3_thread_cpu_seconds_total"


def _delta(before: Mapping[str, float], after: Mapping[str, float], key: str) -> float | None:
    return after[key] - before.get(key, 0.0) if key in after else None


def serving_path_between(before: Mapping[str, float], after: Mapping[str, float], duration_s: float,
                         client_cpu_s: float) -> dict | None:
    """The accounting above, or None when the server does not expose it or ran no iteration."""
    iterations = _delta(before, after, ITERATIONS)
    step = _delta(before, after, "eagle3_engine_step_seconds_total")
    if not iterations or step is None:
        return None
    ms = 1000.0 / iterations
    host = _delta(before, after, "eagle3_scheduler_host_seconds_total") or 0.0
    cpu = {key.split('thread="', 1)[1].split('"', 1)[0]: _delta(before, after, key) * ms
           for key in after if key.startswith(CPU + "{")}
    cpu["client"] = client_cpu_s * ms
    return {"iterations": int(iterations), "wall_ms": duration_s * ms, "engine_step_ms": step * ms,
            "scheduler_host_ms": host * ms, "device_wait_ms": max(step - host, 0.0) * ms,
            "deliver_ms": (_delta(before, after, "eagle3_engine_deliver_seconds_total") or 0.0) * ms,
            "cpu_ms": cpu}


def serving_path_line(path: Mapping) -> str:
    """One line of the accounting, e.g. for a log."""
    cpu = ", ".join(f"{role} {value:.2f}" for role, value in sorted(path["cpu_ms"].items()))
    return (f"per iteration ({path['iterations']}): wall {path['wall_ms']:.2f} ms, engine step "
            f"{path['engine_step_ms']:.2f} (host {path['scheduler_host_ms']:.2f}, device wait "
            f"{path['device_wait_ms']:.2f}), deliver {path['deliver_ms']:.2f}; CPU ms: {cpu}")
