"""Flag helpers the scripts share (eagle3_jax/cli): integer list flags and the training flags'
checks, each a one-line usage error naming the flag."""

from __future__ import annotations

import pytest
from absl import app, flags

from eagle3_jax.cli.flags import int_list
from eagle3_jax.cli.runs import check_training_flags


def test_int_list_reads_integers_and_names_the_flag():
    assert int_list(["1", "64"], "batches") == [1, 64]
    assert int_list([], "batches") == [] and int_list(["0"], "batches") == [0]
    with pytest.raises(app.UsageError, match=r"^--batches must be comma-separated integers; got '1,a'$"):
        int_list(["1", "a"], "batches")


def test_positive_int_list_refuses_empty_and_below_one():
    assert int_list(["1", "2"], "concurrency", positive=True) == [1, 2]
    for values in ([], ["0"], ["4", "-1"], ["x"]):
        with pytest.raises(app.UsageError, match=r"^--concurrency must be comma-separated integers >= 1; got '"):
            int_list(values, "concurrency", positive=True)


def _training_flags(args: list[str], with_grad_norm: bool = True) -> flags.FlagValues:
    values = flags.FlagValues()
    flags.DEFINE_float("learning_rate", 1e-3, "", flag_values=values)
    flags.DEFINE_float("eval_fraction", 0.05, "", flag_values=values)
    if with_grad_norm:
        flags.DEFINE_float("max_grad_norm", 0.5, "", flag_values=values)
    values(["train.py", *args])
    return values


def test_training_flags_are_checked_in_order_and_max_grad_norm_only_where_defined():
    check_training_flags(_training_flags([]))
    check_training_flags(_training_flags(["--eval_fraction=0"]))
    cases = ((["--learning_rate=0", "--eval_fraction=2"], r"--learning_rate must be > 0; got 0.0"),
             (["--max_grad_norm=0"], r"--max_grad_norm must be > 0; got 0.0"),
             (["--eval_fraction=1"], r"--eval_fraction must be in \[0, 1\); got 1.0"))
    for args, message in cases:
        with pytest.raises(app.UsageError, match=message):
            check_training_flags(_training_flags(args))
    check_training_flags(_training_flags([], with_grad_norm=False))  # train_target.py has no --max_grad_norm
