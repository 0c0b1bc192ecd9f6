"""What train_draft.py and train_target.py share: the checks of their training flags, and whether a
run starts, resumes or is already done, decided before any model loads.

A checkpoint folder resumes only the run that wrote it (eagle3_jax.train.run_record): the same
settings and the same data. Anything else is refused with the settings that differ and the two ways
on (--overwrite to start again, or another --out); a run whose output is already written says so
and exits 0.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Mapping

from absl import app, flags

from ..checkpoint.atomic import clash_with_input
from ..train import run_record
from ..train.split import held_out_count
from . import script as cli

FLAGS = flags.FLAGS


def check_training_flags(values: flags.FlagValues = FLAGS) -> None:
    """A usage error for the training flags no validator covers: --learning_rate must be > 0,
    --max_grad_norm (where the script has it) > 0, --eval_fraction in [0, 1)."""
    if not values.learning_rate > 0:
        raise app.UsageError(f"--learning_rate must be > 0; got {values.learning_rate}")
    if "max_grad_norm" in values and not values.max_grad_norm > 0:
        raise app.UsageError(f"--max_grad_norm must be > 0; got {values.max_grad_norm}")
    if not 0 <= values.eval_fraction < 1:
        raise app.UsageError(f"--eval_fraction must be in [0, 1); got {values.eval_fraction}")


def check_enough_examples(num_examples: int, given: str, fix: str) -> None:
    """A usage error when `num_examples` cannot fill one batch of --batch_size once the held-out share
    (--eval_fraction, at least one batch) is taken; `given` says what gave them ("--corpus c.npy has
    24 rows"), `fix` how to give more."""
    n_eval = held_out_count(num_examples, FLAGS.eval_fraction, FLAGS.batch_size)
    if num_examples - n_eval < FLAGS.batch_size:
        raise app.UsageError(f"{given}; {n_eval} held out for evaluation (at least --batch_size) leave "
                             f"{max(num_examples - n_eval, 0)}, less than one batch of --batch_size={FLAGS.batch_size}: "
                             f"{fix} or lower --batch_size")


def read_token_corpus(path: str, min_len: int = 1, vocab_size: int | None = None):
    """The --corpus token rows, memory-mapped: a usage error (one line) unless `path` is an integer
    .npy [N, L >= min_len] whose ids lie in [0, vocab_size) (when given)."""
    import numpy as np

    if not os.path.isfile(path):
        raise app.UsageError(f"--corpus {path} does not exist or is not a file")
    with cli.usage_errors(f"--corpus {path}"):  # not a .npy file
        corpus = np.load(path, mmap_mode="r")
    if corpus.ndim != 2 or corpus.shape[1] < min_len or not np.issubdtype(corpus.dtype, np.integer):
        raise app.UsageError(f"--corpus must be integer token ids [N, L >= {min_len}]; got {corpus.dtype} {corpus.shape}")
    if vocab_size is not None and corpus.size and (corpus.min() < 0 or corpus.max() >= vocab_size):
        raise app.UsageError(f"--corpus token ids must lie in [0, {vocab_size}) (the model's vocabulary); got "
                             f"[{corpus.min()}, {corpus.max()}]")
    return corpus


def settings_of(names: tuple[str, ...]) -> dict[str, Any]:
    """{"--name": value} of the flags that shape a run's result."""
    return {f"--{name}": FLAGS[name].value for name in names}


def defaults_of(settings: Mapping[str, Any]) -> dict[str, Any]:
    """{"--name": default} for the flags among `settings`' names: what a setting missing from a record
    written before the flag existed stands for (the run ran as its default)."""
    return {name: FLAGS[name[2:]].default for name in settings if name.startswith("--") and name[2:] in FLAGS}


def plan_run(out: str, ckpt_dir: str, settings: Mapping[str, Any], fingerprint: str,
             inputs: Mapping[str, str | None], what: str = "model") -> str:
    """"start", "resume" or "finished" (said, naming the `what` it wrote) for a run writing `out` with
    checkpoints in `ckpt_dir`; a usage error (one line) for checkpoints of another run or an output
    the run may not write. With --overwrite, another run's checkpoints, or this run's finished ones,
    are deleted (only when they hold nothing else): it trains again."""
    clash = clash_with_input(ckpt_dir, inputs, "--ckpt_dir")
    if clash:
        raise app.UsageError(clash)
    # the responses a run kept before it stopped, ahead of any checkpoint, are not a run's checkpoints:
    # they carry their own key (data.load_examples) and are reused where it matches
    has_checkpoints = os.path.isdir(ckpt_dir) and any(not n.startswith(run_record.REGENERATED_FILE)
                                                      for n in os.listdir(ckpt_dir))
    if has_checkpoints:
        record = run_record.read_record(ckpt_dir)
        if record is None:
            why = "checkpoints that record no settings"
        else:
            diffs = run_record.differences(record["settings"], settings, defaults_of(settings))
            if record.get("data") != fingerprint:
                diffs.append("the data (prompts / corpus / model files changed)")
            why = "checkpoints of another run: " + ", ".join(diffs) if diffs else ""
        finished = record is not None and record.get("finished") and os.path.isdir(out)
        if not why and not (finished and FLAGS.overwrite):
            if finished:
                print(f"{out} already holds this run's {what} (its checkpoints in {ckpt_dir} are finished); nothing "
                      "to do (--overwrite trains again)")
                return "finished"
            if os.path.lexists(out):  # an output this run did not write
                cli.check_output("--out", out, inputs)
            return "resume"
        if why and not FLAGS.overwrite:
            raise app.UsageError(f"{ckpt_dir} holds {why}; pass --overwrite to start again, or choose another --out")
        if not run_record.is_ours(ckpt_dir):
            raise app.UsageError(f"--ckpt_dir {ckpt_dir} holds files a training run did not write; choose another "
                                 "--ckpt_dir")
        shutil.rmtree(ckpt_dir)
    cli.check_output("--out", out, inputs)
    return "start"
