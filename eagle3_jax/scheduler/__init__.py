"""The serving scheduler: continuous batching over a paged KV cache (core.py), the running batch
with its admission, pages and preemption (batch.py), its device programs and their cache
(programs.py), what a server compiles ahead (warmup.py), multi-host lockstep (lockstep.py) and
counters (metrics.py)."""

from .batch import MIN_CHUNK_BUCKET, MIN_PAGES_BUCKET, PREFILL_CHUNK, bucket
from .core import CapacityError, RequestDelta, Scheduler
from .programs import DeviceState, ProgramCache
from .warmup import WarmUp

__all__ = ["CapacityError", "DeviceState", "MIN_CHUNK_BUCKET", "MIN_PAGES_BUCKET", "PREFILL_CHUNK", "ProgramCache", "RequestDelta",
           "Scheduler", "WarmUp", "bucket"]
