"""A small, deterministic training loop shared by draft (TTT) and target (LM) training.

- AdamW with linear warmup + cosine decay and global-norm gradient clipping (optax).
- fp32 master weights; the loss runs on a `compute_dtype` copy (bf16 by default).
- Data parallel over the mesh's `data` axis: the batch is sharded on its first axis (or as
  `batch_spec` says: context parallelism shards the sequence axis). The state (weights, AdamW
  moments) is replicated, XLA inserting the gradient all-reduce, or with `shard_state` split over
  the mesh's devices (placement.py: ZeRO-3 style, the step gathering weights and reduce-scattering
  gradients). A batch that is already on the devices (the teacher's features computed there) is
  resharded there, never copied through the host.
- Orbax checkpoints of (params, optimizer state, step) every `checkpoint_every` steps and at each
  epoch end. A restart restores the latest one and skips the batches it already consumed, so
  with the same seed and data order it continues the same loss curve.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from ..models.target import resolve_dtype
from ..runtime.extras import require
from .placement import global_array, replicated_shardings, sharded_shardings

optax = require("optax", "train", "training")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    compute_dtype: str = "bfloat16"
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.learning_rate <= 0 or self.warmup_steps < 0 or self.max_grad_norm <= 0:
            raise ValueError(f"invalid TrainConfig: {self}")


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def make_optimizer(tc: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    warmup = min(tc.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=tc.learning_rate * tc.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.max_grad_norm),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


LossFn = Callable[[dict, dict, dict], tuple[jax.Array, dict]]  # (compute params, frozen, batch) -> loss, metrics


def compiled_bytes(compiled) -> dict[str, int]:
    """XLA's plan of a compiled program, per device: arguments, outputs, temporaries."""
    stats = compiled.memory_analysis()
    return {"arguments": int(stats.argument_size_in_bytes), "outputs": int(stats.output_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes)}


def compute_loss_fn(loss_fn: LossFn, compute_dtype) -> LossFn:
    """`loss_fn` on a `compute_dtype` copy of the float32 weights (integer leaves kept)."""
    def compute_loss(p, frozen, batch):
        pc = jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
        return loss_fn(pc, frozen, batch)

    return compute_loss


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, compute_dtype) -> Callable:
    """(state, frozen, batch) -> (next state, metrics with the gradient norm): one AdamW step of
    `loss_fn` (what `Trainer` jits, and the training planner compiles from shapes)."""
    compute_loss = compute_loss_fn(loss_fn, compute_dtype)

    def train_step(state: TrainState, frozen, batch):
        (_, metrics), grads = jax.value_and_grad(compute_loss, has_aux=True)(state.params, frozen, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state), metrics

    return train_step


class Trainer:
    """Runs `loss_fn` over epochs of batches; params are the trainable fp32 pytree. On a `mesh` the
    state and the frozen params are split over its devices with `shard_state`, else replicated."""

    def __init__(self, loss_fn: LossFn, params: dict, frozen: dict, tc: TrainConfig, total_steps: int,
                 ckpt_dir: str | None = None, mesh: jax.sharding.Mesh | None = None,
                 batch_spec: PartitionSpec = PartitionSpec("data"), shard_state: bool = False):
        self.tc = tc
        self.mesh = mesh
        self.batch_spec = batch_spec
        self.total_steps = int(total_steps)
        self.optimizer = make_optimizer(tc, total_steps)
        self.compute_dtype = resolve_dtype(tc.compute_dtype)
        self._layout = sharded_shardings if shard_state else replicated_shardings
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        self.frozen = self._place(frozen)
        self.state = self._place(TrainState(step=jnp.int32(0), params=params, opt_state=self.optimizer.init(params)))
        self._manager = None
        if ckpt_dir is not None:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(
                os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        compute_loss = compute_loss_fn(loss_fn, self.compute_dtype)
        train_step = make_train_step(loss_fn, self.optimizer, self.compute_dtype)
        # The state keeps its layout from step to step (left to itself, XLA may return it gathered).
        out_state = None if mesh is None else self._layout(self.state, mesh)
        self._train_step = jax.jit(train_step, donate_argnums=(0,), out_shardings=(out_state, None))
        self._eval_step = jax.jit(lambda p, frozen, batch: compute_loss(p, frozen, batch)[1])

    # ---- placement -----------------------------------------------------------------------------
    def _place(self, tree):
        if self.mesh is None:
            return tree
        return jax.device_put(tree, self._layout(tree, self.mesh))

    def _shard_batch(self, batch: dict) -> dict:
        if self.mesh is None:
            return {k: v if isinstance(v, jax.Array) else jnp.asarray(np.asarray(v)) for k, v in batch.items()}
        out = {}
        for k, v in batch.items():
            for dim, (size, axis) in enumerate(zip(np.shape(v), self.batch_spec)):
                if axis is not None and size % self.mesh.shape[axis]:
                    what = "batch size" if dim == 0 else f"batch axis {dim} ({k})"
                    raise ValueError(f"{what} {size} is not divisible by the mesh's {axis} axis ({self.mesh.shape[axis]})")
            # a device array (the teacher's output) moves between devices; a host array is uploaded
            sharding = NamedSharding(self.mesh, self.batch_spec)
            out[k] = jax.device_put(v, sharding) if isinstance(v, jax.Array) else global_array(v, sharding)
        return out

    def step(self, batch: dict) -> dict:
        """One training step on `batch` (host arrays, placed on the mesh); its metrics (device arrays)."""
        self.state, metrics = self._train_step(self.state, self.frozen, self._shard_batch(batch))
        return metrics

    def planned_bytes(self, batch: dict) -> dict[str, int]:
        """XLA's plan for one training step on a batch of these shapes (arrays or ShapeDtypeStructs),
        per device, from shapes alone: arguments (state, frozen params, batch), outputs, temporaries."""
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=None if self.mesh is None
                                          else NamedSharding(self.mesh, self.batch_spec)) for k, v in batch.items()}
        return compiled_bytes(self._train_step.lower(self.state, self.frozen, shapes).compile())

    # ---- checkpoints -----------------------------------------------------------------------------
    def restore_latest(self) -> int:
        """Restore the newest checkpoint if there is one; returns the step reached (0 if none)."""
        if self._manager is None or self._manager.latest_step() is None:
            return 0
        import orbax.checkpoint as ocp

        step = self._manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state)
        self.state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return int(step)

    def save(self) -> None:
        if self._manager is not None and self._manager.latest_step() != int(self.state.step):
            import orbax.checkpoint as ocp

            self._manager.save(int(self.state.step), args=ocp.args.StandardSave(self.state), force=True)
            self._manager.wait_until_finished()

    def save_params(self, path: str | os.PathLike) -> None:
        """The current weights alone as an Orbax checkpoint at `path`, replacing one there (a run's
        best draft so far: the rolling checkpoints keep only the latest)."""
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.abspath(path), self.state.params, force=True)
        checkpointer.wait_until_finished()

    def load_params(self, path: str | os.PathLike) -> dict:
        """Weights `save_params` wrote, in the layout of the current ones."""
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state.params)
        return ocp.StandardCheckpointer().restore(os.path.abspath(path), abstract)

    # ---- loops -----------------------------------------------------------------------------------
    def fit(self, batches: Callable[[int], Iterable[dict]], steps_per_epoch: int,
            evaluate: Callable[[dict], dict] | None = None, progress: bool = True,
            log: Callable[[str], None] = print, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Train for tc.epochs; `batches(epoch)` yields the epoch's batches in a fixed order.

        Resumes from the latest checkpoint (saying so); whether the checkpoints are of the same run is
        the caller's to check (`run_record`). Returns per-epoch summaries (mean train metrics, plus
        `evaluate(params)` results when given); `on_step(step, metrics)` sees every step.
        """
        from tqdm import tqdm

        done = self.restore_latest()
        if done >= self.total_steps:
            log(f"all {self.total_steps} steps were trained before; nothing left to train")
        elif done:
            log(f"resuming from step {done} of {self.total_steps}")
        history = []
        for epoch in range(self.tc.epochs):
            first = epoch * steps_per_epoch
            if done >= first + steps_per_epoch:
                continue
            sums: dict[str, float] = {}
            count = 0
            bar = tqdm(total=steps_per_epoch, initial=max(done - first, 0), desc=f"epoch {epoch + 1}/{self.tc.epochs}",
                       disable=not progress, leave=False)
            for i, batch in enumerate(_take(batches(epoch), steps_per_epoch)):
                if first + i < done:
                    continue  # consumed before the restart
                host = {k: float(v) for k, v in jax.device_get(self.step(batch)).items()}
                for k, v in host.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
                bar.update(1)
                bar.set_postfix(loss=f"{host['loss']:.3f}")
                step = int(self.state.step)
                if on_step is not None:
                    on_step(step, host)
                if self._manager is not None and step % self.tc.checkpoint_every == 0:
                    self.save()
            bar.close()
            summary = {"epoch": epoch + 1, "step": int(self.state.step)}
            summary.update({f"train_{k}": v / max(count, 1) for k, v in sums.items()})
            if evaluate is not None:
                summary.update(evaluate(self.state.params))
            self.save()
            history.append(summary)
            log(format_summary(summary))
        return history

    def evaluate(self, batches: Iterable[dict]) -> dict:
        """Mean metrics of `batches` under the current params (prefixed `eval_`)."""
        sums: dict[str, float] = {}
        n = 0
        for batch in batches:
            m = jax.device_get(self._eval_step(self.state.params, self.frozen, self._shard_batch(batch)))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
        return {f"eval_{k}": v / max(n, 1) for k, v in sums.items()}


def _take(it: Iterable[dict], n: int) -> Iterator[dict]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def format_summary(s: dict) -> str:
    """One line per epoch: scalar metrics, then per-step series (name_0, name_1, ...) as lists."""
    import re

    scalars, series = [], {}
    for k in sorted(k for k in s if k not in ("epoch", "step")):
        m = re.fullmatch(r"(.+)_(\d+)", k)
        if m:
            series.setdefault(m.group(1), []).append((int(m.group(2)), s[k]))
        else:
            scalars.append(f"{k} {s[k]:.4g}")
    lists = [f"{name} [{' '.join(f'{v:.3f}' for _, v in sorted(vals))}]" for name, vals in series.items()]
    return f"epoch {s['epoch']} (step {s['step']}): " + ", ".join(scalars + lists)
