"""Draft training's memory and speed against the sequence length (`scripts/bench_train.py`).

A point is one training-step program: a fresh draft for a target (`DraftTraining`, as `train_draft.py` makes it),
`batch_size` sequences of `length` positions, the TTT unroll `ttt_steps` deep, in the bounded form
(`TTTMemory()`: blocks, chunks, rematerialised steps) or held whole (`TTTMemory.whole()`, the
quadratic baseline), on one device or a mesh (rows over `data`, or each sequence over it with
`context_parallel`). Each point runs in a process of its own, so the peak resident set it reports is
its own; it reports:

- XLA's plan for the step per device (arguments, outputs, temporaries, from shapes alone) and its
  peak: what is live at once on a device;
- the process's peak resident set (which also holds the Python heap, the target used to build the
  draft and the compiled code) and that peak less the resident set before the first step;
- training tokens per second over `steps` timed steps after one untimed (compile) step.

Features and teacher logits are random (the step's cost does not depend on their values).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
import time
from typing import Sequence

import jax
import numpy as np

from ..models.target import load_target
from ..runtime.sharding import make_mesh
from ..train.data import row_positions
from ..train.draft_run import DraftData, DraftRecipe, DraftTraining
from ..train.trainer import TrainConfig
from ..train.ttt import TTTMemory
from ..train.vocab import DraftVocab


@dataclasses.dataclass(frozen=True)
class TrainPoint:
    target: str
    length: int
    batch_size: int = 1
    ttt_steps: int = 7
    draft_arch: str = "llama"
    draft_vocab_size: int = 0
    compute_dtype: str = "bfloat16"
    bounded: bool = True
    mesh: tuple[int, int, int] | None = None
    context_parallel: bool = False
    steps: int = 2
    seed: int = 0

    @property
    def label(self) -> str:
        form = "bounded" if self.bounded else "whole"
        layout = "" if self.mesh is None else f" mesh {','.join(map(str, self.mesh))}" + (
            " context-parallel" if self.context_parallel else "")
        return f"{form}{layout} T={self.length}"


def _resident_bytes() -> int:
    """The process's current resident set (Linux /proc; 0 where it is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _random_batch(point: TrainPoint, hidden: int, vocab: DraftVocab, rng: np.random.Generator) -> dict:
    b, t, vd = point.batch_size, point.length, vocab.draft_vocab_size
    return dict(tokens=rng.integers(0, vocab.vocab_size, (b, t)).astype(np.int32),
                loss_mask=np.ones((b, t), bool),
                aux=rng.standard_normal((b, t, 3 * hidden)).astype(np.float32),
                teacher_hidden=rng.standard_normal((b, t, hidden)).astype(np.float32),
                teacher_argmax=vocab.draft_ids[rng.integers(0, vd, (b, t))].astype(np.int32))


def run_point(point: TrainPoint) -> dict:
    """Measure `point` in this process (see the module docstring)."""
    target = load_target(point.target, dtype="float32")
    cfg_t = target.config
    rng = np.random.default_rng(point.seed)
    vd = point.draft_vocab_size or cfg_t.vocab_size
    vocab = DraftVocab.from_draft_ids(np.sort(rng.choice(cfg_t.vocab_size, vd, replace=False)), cfg_t.vocab_size)
    batch = _random_batch(point, cfg_t.hidden_size, vocab, rng)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    positions = row_positions(tokens)  # one sequence per row
    recipe = DraftRecipe(arch=point.draft_arch, ttt_steps=point.ttt_steps, batch_size=point.batch_size,
                         context_parallel=point.context_parallel, seed=point.seed)
    tc = TrainConfig(epochs=point.steps + 1, compute_dtype=point.compute_dtype, warmup_steps=0, seed=point.seed)
    trainer = DraftTraining(target, DraftData(vocab, tokens, mask, positions, tokens, mask, positions), recipe, tc,
                            mesh=None if point.mesh is None else make_mesh(*point.mesh),
                            memory=TTTMemory() if point.bounded else TTTMemory.whole()).trainer
    plan = trainer.planned_bytes(batch)
    resident_before = _resident_bytes()
    times = []
    for _ in range(point.steps + 1):
        start = time.perf_counter()
        metrics = trainer.step(batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    return {**dataclasses.asdict(point), "label": point.label, "plan_bytes": plan,
            "plan_peak_bytes": plan["arguments"] + plan["outputs"] + plan["temporaries"],
            "peak_resident_bytes": peak, "resident_before_steps_bytes": resident_before,
            "peak_over_start_bytes": peak - resident_before, "first_step_s": times[0],
            "step_s": step_s, "tokens_per_s": point.batch_size * point.length / step_s,
            "loss": float(metrics["loss"])}


def run_in_process(point: TrainPoint, timeout_s: float) -> dict:
    """`run_point` in a fresh Python process (its own peak resident set); an `error` entry if it fails."""
    code = (f"import json, sys; from eagle3_jax.bench.train_memory import TrainPoint, run_point; "
            f"print(json.dumps(run_point(TrainPoint(**json.loads(sys.argv[1])))))")
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(dataclasses.asdict(point))],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**dataclasses.asdict(point), "label": point.label, "error": f"over {timeout_s:.0f} s"}
    if done.returncode:
        return {**dataclasses.asdict(point), "label": point.label,
                "error": (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(rows: Sequence[dict]) -> list[dict]:
    """Each measured row's peaks against the same form's row at half its length (when there is one)."""
    by_key = {(r["bounded"], r["mesh"] and tuple(r["mesh"]), r["context_parallel"], r["length"]): r
              for r in rows if "error" not in r}
    out = []
    for r in rows:
        half = by_key.get((r["bounded"], r["mesh"] and tuple(r["mesh"]), r["context_parallel"], r["length"] // 2))
        if "error" in r or half is None or r["length"] % 2:
            out.append(r)
            continue
        out.append(dict(r, plan_peak_vs_half=r["plan_peak_bytes"] / half["plan_peak_bytes"],
                        resident_peak_vs_half=r["peak_over_start_bytes"] / max(half["peak_over_start_bytes"], 1)))
    return out


def markdown(rows: Sequence[dict], header: str) -> str:
    """The rows as a markdown table (MiB, tokens per second, ratios to half the length)."""
    mib = 2 ** 20
    lines = [header, "", "| point | plan peak MiB (temps) | x half length | peak RSS over start MiB | x half length "
             "| tokens/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | |")
            continue
        x = lambda key: f"{r[key]:.2f}x" if key in r else "-"  # noqa: E731
        lines.append(f"| {r['label']} | {r['plan_peak_bytes'] / mib:.0f} ({r['plan_bytes']['temporaries'] / mib:.0f}) "
                     f"| {x('plan_peak_vs_half')} | {r['peak_over_start_bytes'] / mib:.0f} | {x('resident_peak_vs_half')} "
                     f"| {r['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"
