"""A draft trained from the target's own responses, after regeneration (what scripts/train_draft.py
runs once its flags and inputs are checked): the examples split into training and held-out sets,
the draft vocabulary chosen from the training responses, both sets packed to one length, teacher
features computed on the fly or written once to a feature store, training-time-test training
and the HF export.

`regenerated_examples` has the target answer the prompts once and keeps the responses for a resume
or another draft; `DraftRecipe` holds the settings that shape the draft; `prepare_data` makes the
`DraftData` the rest reads; `train_batches` picks the online or offline batches; `DraftTraining`
builds the draft, its trainer (resuming from its checkpoints), trains and exports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Iterable, Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..config.draft import DraftConfig
from ..config.model import ModelConfig
from ..engine import Engine
from ..models.draft import Draft
from ..models.target import Target
from ..parsers.defaults import output_parsers
from ..text.tokenizer import load_tokenizer
from ..planning.report import replication_notes
from ..weights.params import flat_specs
from .data import Example, load_examples, online_batches, pack, regenerate, save_examples
from .feature_store import FeatureStore, rows_digest, write_feature_store
from .draft_model import assembled_params, init_draft_params, make_ttt_loss, new_draft_config
from .conversations import Conversation, regenerate_conversations
from .export import draft_config_json, export_hf_draft
from .measure import Measurement, measured_acceptance, serving_draft
from .placement import host_copy, writes_files
from .run_record import BEST_DIR, BEST_FILE, model_digest
from .split import held_out_count, split_examples  # noqa: F401 (draft_run's names too)
from .trainer import TrainConfig, Trainer
from .ttt import TTTMemory, check_context_split
from .vocab import DraftVocab, count_tokens, select_draft_vocab

Batches = Callable[[int], Iterable[dict]]  # epoch -> that epoch's batches, in a fixed order


@dataclasses.dataclass(frozen=True)
class DraftRecipe:
    """The draft a run trains and the data it trains on: a draft vocabulary of `vocab_size` ids (0:
    the target's whole vocabulary), `num_layers` decoder layers of `arch` ("llama" or "mla") with
    an MLP `intermediate_size` wide (0: 4 x hidden), a training-time-test unroll `ttt_steps` deep,
    batches of `batch_size` sequences, an `eval_fraction` share held out and `seed` for the data
    order and the initial weights. `fc_norm`, `norm_output`, `norm_before_fc`: the EAGLE 3.1
    switches (models/draft.py), which the training-time test follows as serving does;
    `sliding_window` > 0: every draft layer attends over that many tokens (0: the whole context).
    `context_parallel`: each sequence split over the mesh's `data` axis (every device its share of
    every sequence: for sequences one device cannot hold) instead of the batch's rows."""

    vocab_size: int = 0
    arch: str = "llama"
    num_layers: int = 1
    intermediate_size: int = 0
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    sliding_window: int = 0
    context_parallel: bool = False
    ttt_steps: int = 7
    batch_size: int = 16
    eval_fraction: float = 0.05
    seed: int = 0


def recipe_draft_config(target_cfg: ModelConfig, vocab: DraftVocab, recipe: DraftRecipe) -> DraftConfig:
    """The config of the draft `recipe` describes, for a target of `target_cfg` and `vocab`."""
    return dataclasses.replace(
        new_draft_config(target_cfg, vocab, arch=recipe.arch, num_layers=recipe.num_layers,
                         intermediate_size=recipe.intermediate_size or None),
        fc_norm=recipe.fc_norm, norm_output=recipe.norm_output, norm_before_fc=recipe.norm_before_fc,
        layer_windows=(recipe.sliding_window,) * recipe.num_layers if recipe.sliding_window else None)


def batch_spec(recipe: DraftRecipe) -> PartitionSpec:
    """How a batch lies on the mesh: rows over `data`, or with context parallelism each sequence."""
    return PartitionSpec(None, "data") if recipe.context_parallel else PartitionSpec("data")


def kept_examples(kept: str, key: dict, make: Callable[[], Sequence[Example]],
                  key_defaults: dict | None = None) -> tuple[Sequence[Example], bool]:
    """The examples kept in the .npz `kept` under `key` (the settings and data that made them), else
    `make()`'s, kept there (by process 0; every process makes them alike); and whether they were
    read. Kept under another key: data.StaleExamples naming what differs (`key_defaults`: what a
    setting missing from one key stands for, data.load_examples)."""
    examples = load_examples(kept, key, key_defaults)
    if examples is not None:
        return examples, True
    examples = make()
    return (save_examples(kept, examples, key) if writes_files() else examples), False


def regenerated_examples(target: Target, prompts: Sequence[Sequence[int]] | Sequence[Conversation], kept: str,
                         key: dict, key_defaults: dict | None = None, **generation) -> tuple[Sequence[Example], bool]:
    """The target's responses to `prompts` (`data.regenerate` with `generation`'s keywords), or to
    every assistant turn of conversations (`regenerated_conversations`, greedy: of the keywords it
    reads max_tokens, batch_size and draft), kept in or read from `kept` (`kept_examples`)."""
    if prompts and isinstance(prompts[0], Conversation):
        return kept_examples(kept, key, lambda: regenerated_conversations(
            target, prompts, max_tokens=generation["max_tokens"], batch_size=generation.get("batch_size", 32),
            draft=generation.get("draft")), key_defaults)
    return kept_examples(kept, key, lambda: regenerate(target, prompts, **generation), key_defaults)


def regenerated_conversations(target: Target, conversations: Sequence[Conversation], *, max_tokens: int,
                              batch_size: int, draft: Draft | None = None) -> list[Example]:
    """Every assistant turn of `conversations` answered again by `target` (speculating with `draft`
    when given: the same tokens), turn by turn
    (conversations.regenerate_conversations), rendered with its chat template and parsed by the
    parsers its family serves with (parsers.defaults.output_parsers); a ValueError naming the
    conversation when one cannot fit the target's positions."""
    tok = load_tokenizer(target.path, bos_id=target.config.bos_token_id)
    parsers = output_parsers(target.config.model_type, tok.chat_template)
    needs = [len(tok.encode(tok.apply_chat_template(list(c.messages), tools=c.tools, add_generation_prompt=False)))
             + max_tokens * len(c.assistant_turns) for c in conversations]
    positions = target.config.max_position_embeddings
    if max(needs) > positions:
        i = int(np.argmax(needs))
        raise ValueError(f"conversation {i} may grow to {needs[i]} tokens (its turns plus max_tokens per answer), past "
                         f"the target's {positions} positions: drop it or lower max_tokens")
    engine = Engine(target, draft, max_batch_size=batch_size, max_seq_len=max(needs), tokenizer=tok)
    return regenerate_conversations(engine, conversations, max_tokens=max_tokens,
                                    tool_call_parser=parsers.tool_call_parser, reasoning_parser=parsers.reasoning_parser)


def check_target_mesh(cfg: ModelConfig, mesh_shape: tuple[int, int, int], dtype: str) -> None:
    """A ValueError when a mesh axis leaves some of the target's tensors whole on every device instead
    of splitting them (its size does not divide theirs): a training mesh is there to spread the
    target, so the nearest meshes that divide are named instead (planning/report.py)."""
    notes = replication_notes(flat_specs(cfg), mesh_shape, dtype, 2**30, "GiB")
    if notes:
        raise ValueError(notes[0])


@dataclasses.dataclass(frozen=True)
class DraftData:
    """A run's packed data: token ids, loss masks and positions [N, seq_len] of the training and held-out
    examples (rows of the longest example's length, several examples to a row where they fit:
    `data.pack`), and the draft vocabulary."""

    vocab: DraftVocab
    train_tokens: np.ndarray
    train_mask: np.ndarray
    train_positions: np.ndarray
    eval_tokens: np.ndarray
    eval_mask: np.ndarray
    eval_positions: np.ndarray
    eval_prompts: tuple[tuple[int, ...], ...] = ()  # the held-out examples' prompts (tokens before the response)
    train_lengths: tuple[int, ...] = ()  # the training examples' lengths

    def summary(self) -> str:
        """The draft vocabulary's coverage and how the training examples were packed, in a line."""
        v, rows = self.vocab, self.train_tokens
        return (f"draft vocabulary: {v.draft_vocab_size} of {v.vocab_size} ids, covering {v.covered_mass:.4f} of "
                f"response tokens; {len(self.train_lengths)} training examples packed in {len(rows)} rows of "
                f"{rows.shape[1]} positions ({sum(self.train_lengths) / max(rows.size, 1):.0%} used)")


def prepare_data(examples: Sequence[Example], target_vocab_size: int, recipe: DraftRecipe,
                 length_multiple: int = 1) -> DraftData:
    """The examples split (`split_examples`), the draft vocabulary chosen from the training
    responses' token counts (held-out ones do not count), both sets packed (`data.pack`, at least a
    batch of rows each) in rows of the longest length rounded up to a multiple of `length_multiple`
    (context parallelism's shard count)."""
    train, held_out = split_examples(examples, recipe.eval_fraction, recipe.batch_size, recipe.seed)
    counts = count_tokens([e.tokens for e in train], [e.loss_mask for e in train], vocab_size=target_vocab_size)
    vocab = select_draft_vocab(counts, recipe.vocab_size or target_vocab_size)
    seq_len = -(-max(len(e.tokens) for e in examples) // length_multiple) * length_multiple
    prompts = tuple(tuple(int(t) for t in e.tokens[: int(np.argmax(e.loss_mask))]) for e in held_out if e.loss_mask.any())
    rows = recipe.batch_size  # at least a batch of rows each (check_enough_examples counted the examples)
    return DraftData(vocab, *pack(train, seq_len, rows), *pack(held_out, seq_len, rows), tuple(p for p in prompts if p),
                     tuple(len(e.tokens) for e in train))


class StaleFeatureStore(ValueError):
    """A feature store written for other data or another draft vocabulary."""


def store_matches(store: FeatureStore, data: DraftData, target: Target) -> bool:
    """Whether `store` holds `target`'s features of `data`'s training rows (the same tokens at the
    same positions; any draft vocabulary: the store keeps the hidden state its logits come from)."""
    if len(store) != len(data.train_tokens) or store.seq_len != data.train_tokens.shape[1]:
        return False
    if target.path and store.target != model_digest(target.path):
        return False
    return store.rows_digest == rows_digest(data.train_tokens, data.train_positions)


def offline_store(feature_dir: str, target: Target, data: DraftData, *, fresh: bool = False,
                  overwrite: bool = False) -> FeatureStore:
    """The feature store in `feature_dir` for `data`: written when missing or `fresh` (a run that
    starts again), reused when it matches. One that does not match is written again with
    `overwrite`, else refused (StaleFeatureStore)."""
    def write(replace: bool) -> FeatureStore:
        write_feature_store(feature_dir, target, data.train_tokens, data.train_mask, overwrite=replace,
                            positions=data.train_positions)
        return FeatureStore(feature_dir)

    if not os.path.isdir(feature_dir) or fresh:
        return write(overwrite)
    try:
        store = FeatureStore(feature_dir)
        why = None if store_matches(store, data, target) else "was written for other data or another target"
    except (OSError, ValueError) as e:  # another version of the store's format, or a damaged one
        store, why = None, f"cannot be read ({e})"
    if why is None:
        return store
    if not overwrite:
        raise StaleFeatureStore(f"feature store {feature_dir} {why}")
    return write(True)


def train_batches(target: Target, data: DraftData, recipe: DraftRecipe, store: FeatureStore | None = None) -> Batches:
    """Each epoch's training batches: streamed from `store` (offline: each process reads the rows its
    devices take), else with the teacher's features computed by `target` as they are drawn (online)."""
    if store is not None:
        return lambda epoch: store.batches(recipe.batch_size, seed=recipe.seed, epoch=epoch, lazy=True)
    return lambda epoch: online_batches(target, data.train_tokens, data.train_mask, recipe.batch_size,
                                        seed=recipe.seed, epoch=epoch, positions=data.train_positions)


def measurement_of(data: DraftData, num_prompts: int, every: int = 0, max_tokens: int = 64) -> Measurement | None:
    """A measurement on the first `num_prompts` held-out prompts (all of them when fewer are held
    out), every `every` steps and after each epoch; None for 0 prompts or none held out."""
    prompts = data.eval_prompts[:num_prompts]
    return Measurement(prompts=prompts, every=every, max_tokens=max_tokens) if prompts else None




class DraftTraining:
    """A new draft for `target` (config from the recipe, weights initialised from the target where
    they are shared) and its trainer: checkpoints in `ckpt_dir` (it resumes from the latest),
    data-parallel over `mesh` when given (context-parallel with the recipe's `context_parallel`), the
    training-time test bounding its memory as `memory` says. On a mesh the draft's weights and AdamW
    moments are split over every device (trainer.py, `shard_state`); the teacher runs where the
    target's weights are (its own mesh, `data.online_batches`).

    With a `measurement` the draft is measured through the Engine as it trains (measure.py), and the
    draft exported is the one with the highest measured tau (the later one of equals), not
    necessarily the last: acceptance can peak before training ends. Its weights are kept in
    `<ckpt_dir>/best`, so a resumed run still knows it."""

    def __init__(self, target: Target, data: DraftData, recipe: DraftRecipe, tc: TrainConfig, *,
                 ckpt_dir: str | None = None, mesh: Mesh | None = None, memory: TTTMemory = TTTMemory(),
                 measurement: Measurement | None = None):
        if recipe.context_parallel:
            if mesh is None:
                raise ValueError("context parallelism splits each sequence over a mesh's data axis: give a mesh")
            check_context_split(data.train_tokens.shape[1], mesh.shape["data"], recipe.ttt_steps)
        self.target, self.data, self.recipe = target, data, recipe
        self.config = recipe_draft_config(target.config, data.vocab, recipe)
        draft_config_json(self.config)  # a draft the export would refuse is refused before it trains
        params, self.frozen = init_draft_params(self.config, target, data.vocab, seed=recipe.seed)
        self.steps_per_epoch = len(data.train_tokens) // recipe.batch_size
        loss = make_ttt_loss(self.config, data.vocab, recipe.ttt_steps, memory=memory,
                             context=(mesh, "data") if recipe.context_parallel else None)
        self.trainer = Trainer(loss, params, self.frozen, tc, total_steps=self.steps_per_epoch * tc.epochs,
                               ckpt_dir=ckpt_dir, mesh=mesh, shard_state=True,
                               batch_spec=batch_spec(recipe))
        self.measurement, self.ckpt_dir = measurement, ckpt_dir
        self.measured: dict[int, dict] = {}  # step -> measured acceptance
        self.best: dict | None = _read_best(ckpt_dir)
        self._best_params: dict | None = None  # without a checkpoint folder, kept here

    def evaluate(self) -> dict:
        """The held-out set's mean metrics under the current weights (teacher features online), and
        with a measurement the draft's measured acceptance (`measure`) at this step."""
        d = self.data
        out = self.trainer.evaluate(online_batches(self.target, d.eval_tokens, d.eval_mask, self.recipe.batch_size,
                                                   seed=self.recipe.seed, epoch=0, positions=d.eval_positions))
        if self.measurement is not None:
            step = int(self.trainer.state.step)
            measured = self.measured.get(step) or self.measure()
            out["measured_tau"] = measured["tau"]
            out.update({f"measured_acc_{i}": a for i, a in enumerate(measured["per_position"])})
        return out

    def measure(self, log: Callable[[str], None] | None = None) -> dict:
        """The current draft's acceptance through the Engine on the held-out prompts; kept as the best
        when its tau is the highest so far."""
        step = int(self.trainer.state.step)
        draft = serving_draft(self.config, self.trainer.state.params, self.trainer.frozen, self.target)
        result = self.measured[step] = measured_acceptance(self.target, draft, self.measurement)
        if self.best is None or result["tau"] >= self.best["tau"]:
            self.best = dict(result, step=step)
            if self.ckpt_dir is None:
                self._best_params = host_copy(self.trainer.state.params)
            else:
                self.trainer.save_params(os.path.join(self.ckpt_dir, BEST_DIR))
                if writes_files():
                    with open(os.path.join(self.ckpt_dir, BEST_FILE), "w", encoding="utf-8") as f:
                        json.dump(self.best, f)
        if log is not None:
            log(f"step {step}: measured tau {result['tau']:.3f} (best {self.best['tau']:.3f}, step {self.best['step']})")
        return result

    def fit(self, batches: Batches, progress: bool = True, log: Callable[[str], None] = print) -> list[dict]:
        """Train every epoch left (`Trainer.fit`), evaluating after each (and measuring every
        `measurement.every` steps); the epochs' summaries."""
        every = self.measurement.every if self.measurement is not None else 0
        if self.measurement is not None:
            m = self.measurement
            log(f"measuring the draft through the Engine on {len(m.prompts)} held-out prompts ({m.spec.name}, "
                f"{m.max_tokens} tokens each) after each epoch" + (f" and every {every} steps" if every else ""))

        def on_step(step: int, _metrics: dict) -> None:
            if every and step % every == 0:
                self.measure(log)

        return self.trainer.fit(batches, self.steps_per_epoch, evaluate=lambda _params: self.evaluate(),
                                progress=progress, log=log, on_step=on_step)

    def exported_params(self) -> tuple[dict, int]:
        """The weights to export and their step: the best measured draft's, else the current ones."""
        step = int(self.trainer.state.step)
        if self.best is None or self.best["step"] == step:
            return self.trainer.state.params, step
        if self._best_params is not None:
            return self._best_params, self.best["step"]
        return self.trainer.load_params(os.path.join(self.ckpt_dir, BEST_DIR)), self.best["step"]

    def export_note(self) -> str:
        """Which draft `export` writes, and why."""
        if self.best is None:
            return f"the last step's draft, step {int(self.trainer.state.step)}"
        return f"the draft of step {self.best['step']}: the run's best measured tau, {self.best['tau']:.3f}"

    def export(self, out: str, dtype: str = "bfloat16", overwrite: bool = False,
               extra_files: dict[str, str] | None = None) -> str:
        """The trained draft (`exported_params`) as an HF draft folder at `out` (its vocabulary
        mapping only when the draft has its own vocabulary), written by process 0 once every process
        has gathered the weights; returns the folder."""
        params = host_copy(assembled_params(self.exported_params()[0], self.frozen))
        vocab = self.data.vocab if self.config.has_draft_vocab else None
        if not writes_files():
            return out
        return export_hf_draft(out, self.config, params, vocab, dtype=dtype, overwrite=overwrite,
                               extra_files=extra_files)


def _read_best(ckpt_dir: str | None) -> dict | None:
    """The best measured draft's figures a run recorded in `ckpt_dir` (None: none yet)."""
    path = None if ckpt_dir is None else os.path.join(ckpt_dir, BEST_FILE)
    if path is None or not os.path.isfile(path) or not os.path.isdir(os.path.join(ckpt_dir, BEST_DIR)):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
