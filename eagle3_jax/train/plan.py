"""The training planner: what training a draft against a target needs on each device, from shapes alone.

A training step is two compiled programs that share the devices: the teacher (one causal forward of
the target over the batch, sharded as serving shards it: `data.teacher_forward`) and the draft's
training step (the training-time test's loss, its gradient and the AdamW update: `trainer.make_train_step`).
`plan_training` compiles both ahead of time over shape-only sharded arguments, exactly as a run
builds them (the target's weights as `load_target` places them, quantized experts packed; the draft's
state split over the devices as `placement.sharded_shardings` splits it) and reads XLA's
`memorycompiled_bytes()` of each.

The peak is the larger of the two phases, each with what the other keeps resident: the online loader
computes batch n + 1's teacher before step n runs, so
- teacher phase: teacher arguments (target weights, ids) + its temporaries + its outputs (batch n + 1)
  + the step's arguments (draft state, frozen embedding, batch n, waiting);
- step phase: the step's arguments + its temporaries + the target's weights + batch n + 1 (waiting).
The step's updated state aliases its donated input, so its outputs add nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..models.target import resolve_dtype
from ..planning.memory import Device, abstract_setup, compiled_as_on_gpu, float8_as_bytes, planned_kernels
from ..runtime.sharding import mesh_context
from .data import TEACHER_CHUNK, teacher_forward
from .draft_model import make_ttt_loss, trainable_tree
from .draft_run import DraftRecipe, batch_spec, recipe_draft_config
from .placement import sharded_shardings
from .trainer import TrainConfig, TrainState, compiled_bytes, make_optimizer, make_train_step
from .ttt import TTTMemory, check_context_split
from .vocab import DraftVocab


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """Per-device bytes of one training step of `batch` sequences of `seq_len` tokens on a mesh."""

    mesh_shape: dict[str, int]
    seq_len: int
    batch: int
    teacher: dict[str, int]  # memory_analysis of the teacher forward: arguments, temporaries, outputs
    train_step: dict[str, int]  # of the draft's training step
    batch_bytes: int  # one batch of teacher outputs and tokens on this device
    draft_params: int  # the draft's trainable parameters (all devices together)

    @property
    def target_bytes(self) -> int:
        """The target's weights on this device (the teacher's arguments, its ids aside)."""
        return self.teacher["arguments"]

    @property
    def state_bytes(self) -> int:
        """The draft's float32 weights, AdamW moments and frozen embedding on this device."""
        return self.train_step["arguments"] - self.batch_bytes

    @property
    def teacher_phase_bytes(self) -> int:
        t = self.teacher
        return t["arguments"] + t["temporaries"] + t["outputs"] + self.train_step["arguments"]

    @property
    def step_phase_bytes(self) -> int:
        s = self.train_step
        return s["arguments"] + s["temporaries"] + self.target_bytes + self.batch_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.teacher_phase_bytes, self.step_phase_bytes)

    def fits(self, device: Device) -> bool:
        return self.peak_bytes <= device.hbm_bytes

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), target_bytes=self.target_bytes, state_bytes=self.state_bytes,
                    teacher_phase_bytes=self.teacher_phase_bytes, step_phase_bytes=self.step_phase_bytes,
                    peak_bytes=self.peak_bytes)


def _shaped(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _sds(shape: tuple[int, ...], dtype, mesh: Mesh, spec: PartitionSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def plan_training(target, mesh: Mesh, seq_len: int, recipe: DraftRecipe = DraftRecipe(), *,
                  quant: str | None = None, dtype="bfloat16", compute_dtype="bfloat16",
                  memory: TTTMemory = TTTMemory(), teacher_chunk: int = TEACHER_CHUNK, kernels: str = "xla",
                  arch: str | None = None) -> TrainingPlan:
    """Compile the teacher and the draft's training step for `recipe.batch_size` sequences of
    `seq_len` tokens on `mesh` from shapes alone; per-device bytes (see the module's docstring).

    target: an HF or converted folder, a config.json path or a ModelConfig (only its config is
    read); quant and dtype: as `plan_memory` takes them (the target's weights and teacher compute).
    The draft is `recipe`'s (architecture, layers, draft vocabulary of `recipe.vocab_size` ids, 0:
    the target's; TTT depth; context parallelism), its compute in `compute_dtype`; the teacher runs
    in passes of `teacher_chunk` tokens, as a run's does. kernels, arch: the teacher's path, as
    `plan_memory` takes them ("xla" dequantizes int4 / FP8 experts to bfloat16 before the dot, so
    those copies count; "triton" on `arch` plans the GPU's program, each kernel shape-only).
    """
    shards = mesh.shape["data"]
    if recipe.context_parallel:
        check_context_split(seq_len, shards, recipe.ttt_steps)
    elif recipe.batch_size % shards:
        raise ValueError(f"{recipe.batch_size} sequences per step do not split over the data axis ({shards}): "
                         "train a multiple of it, or split each sequence (context parallelism)")
    planned = planned_kernels(kernels, arch)
    setup = abstract_setup(target, mesh=mesh, batch=mesh.shape["data"], max_len=16, quant=quant, dtype=dtype,
                           kernels=planned)
    cfg, dt, b = setup.cfg, resolve_dtype(dtype), recipe.batch_size
    vd = recipe.vocab_size or cfg.vocab_size
    # ids scattered as a counted vocabulary's are (XLA folds the loss's lookups of a contiguous range)
    vocab = DraftVocab.from_draft_ids(np.random.default_rng(0).choice(cfg.vocab_size, vd, replace=False), cfg.vocab_size)
    dcfg = recipe_draft_config(cfg, vocab, recipe)
    rows = PartitionSpec("data" if b % mesh.shape["data"] == 0 else None)
    ids = _sds((b, seq_len), jnp.int32, mesh, rows)
    with compiled_as_on_gpu(planned, arch), mesh_context(mesh):
        teacher = teacher_forward.trace(float8_as_bytes(setup.tparams), cfg, ids, dt, chunk=teacher_chunk)
        teacher_bytes = compiled_bytes(teacher.lower().compile())

    optimizer = make_optimizer(TrainConfig(), total_steps=1000)
    params = trainable_tree(dcfg, lambda name, spec: jax.ShapeDtypeStruct(spec.shape, jnp.float32))
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=jax.eval_shape(optimizer.init, params))
    frozen = {"embed": jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), dt),
              "teacher_head": jax.ShapeDtypeStruct((cfg.hidden_size, vd), dt)}
    if dcfg.has_draft_vocab:
        frozen["d2t"] = jax.ShapeDtypeStruct((vd,), jnp.int32)
    state_shardings = sharded_shardings(state, mesh)
    spec = batch_spec(recipe)
    h3 = len(cfg.aux_layer_ids) * cfg.hidden_size
    batch = {"tokens": _sds((b, seq_len), jnp.int32, mesh, spec), "loss_mask": _sds((b, seq_len), jnp.bool_, mesh, spec),
             "positions": _sds((b, seq_len), jnp.int32, mesh, spec),
             "aux": _sds((b, seq_len, h3), dt, mesh, spec),
             "teacher_hidden": _sds((b, seq_len, cfg.hidden_size), dt, mesh, spec),
             "teacher_argmax": _sds((b, seq_len), jnp.int32, mesh, spec)}
    loss = make_ttt_loss(dcfg, vocab, recipe.ttt_steps, memory=memory,
                         context=(mesh, "data") if recipe.context_parallel else None)
    step = jax.jit(make_train_step(loss, optimizer, resolve_dtype(compute_dtype)), donate_argnums=(0,),
                   out_shardings=(state_shardings, None))
    compiled = step.lower(_shaped(state, state_shardings), _shaped(frozen, sharded_shardings(frozen, mesh)),
                          batch).compile()
    batch_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                      for x in batch.values())
    return TrainingPlan(mesh_shape=dict(mesh.shape), seq_len=seq_len, batch=b, teacher=teacher_bytes,
                        train_step=compiled_bytes(compiled), batch_bytes=batch_bytes,
                        draft_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))
