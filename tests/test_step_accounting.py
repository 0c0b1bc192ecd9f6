"""The step accounting (bench/step_accounting.py) times every phase of the step the scheduler runs,
and leaves the scheduler as it found it."""

from __future__ import annotations

import os

import pytest

import eagle3_jax as e3
from eagle3_jax.bench.step_accounting import PLAIN_PHASES, SPEC_PHASES, account

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 403, 407, 286, 261], [1, 291, 276, 286, 261, 370, 298]]


@pytest.fixture(scope="module")
def pair():
    target = e3.load_target(os.path.join(ROOT, "checkpoints", "stories260K"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", "stories260K-eagle3"), target=target, dtype="float32")
    return target, draft


@pytest.mark.parametrize("mode", ["none", "chain:3:1:4"])
def test_accounting_times_each_phase_and_leaves_the_scheduler_usable(pair, mode):
    target, draft = pair
    spec = e3.SpecConfig.parse(mode)
    sched = e3.Scheduler(target, draft if spec else None, spec, max_num_seqs=2, max_seq_len=128)
    # a batch of two, as the accounting runs (the same programs): twice one prompt, ending together
    before = PROMPTS[:1] * 2
    want = [o.token_ids for o in sched.generate(before, e3.SamplingParams(max_tokens=24))]
    a = account(sched, mode, PROMPTS, batch=2, steps=4, runs=2, max_tokens=100)
    assert tuple(a.phases) == (SPEC_PHASES if spec else PLAIN_PHASES)
    assert all(ms > 0 for ms in a.phases.values()) and a.program_ms > 0 and a.step_ms > 0
    assert 0 < a.host_ms <= a.step_ms and a.batch == 2
    assert a.tokens_per_step == 1.0 if spec is None else 1.0 <= a.tokens_per_step <= spec.max_accept + 1
    row = a.as_dict()
    assert row["phases_ms"] == pytest.approx(sum(a.phases.values()))
    assert row["around_program_ms"] == pytest.approx(a.step_ms - a.program_ms)
    assert not sched.has_unfinished()
    assert [o.token_ids for o in sched.generate(before, e3.SamplingParams(max_tokens=24))] == want
