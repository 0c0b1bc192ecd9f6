"""The request layer's token emission and metrics, against plain references on random streams."""

import random

import numpy as np

import eagle3_jax as e3
from eagle3_jax.request import Request


def _reference_emit(tokens, stops, min_tokens, budget, emitted_before):
    """(tokens kept, finish reason) of one step by the rule: a stop token at or past min_tokens
    ends it (kept), else the budget's last token does."""
    kept, n = [], emitted_before
    for tok in tokens:
        kept.append(tok)
        n += 1
        if tok in stops and n >= min_tokens:
            return kept, "stop"
        if n >= budget:
            return kept, "length"
    return kept, None


def test_emission_keeps_tokens_up_to_a_stop_token_or_the_budget_whatever_the_step_sizes():
    """`emit` token by token, or `take` whole where the scheduler would (nothing in the step ends the
    request: SlotTable.bulk_rows), give the rule's tokens and reason."""
    rng = random.Random(0)
    for _ in range(400):
        stops = tuple(rng.sample(range(8), rng.randint(0, 2)))
        budget = rng.randint(1, 12)
        sampling = e3.SamplingParams(max_tokens=budget, stop_token_ids=stops, min_tokens=rng.randint(0, budget))
        req, want = Request("r", [1], sampling, budget), []
        reason = None
        while reason is None:
            step = [rng.randrange(8) for _ in range(rng.randint(1, 4))]
            kept, want_reason = _reference_emit(step, set(stops), sampling.min_tokens, budget, len(want))
            want += kept
            if req.sent and rng.random() < 0.5 and not set(step) & set(stops) and len(req.output) + len(step) < budget:
                req.take(list(step))  # taken whole: only when nothing in it ends the request
                reason = None
                req.record_steps([len(step)], [0], [1.0], 0)  # its time, as the scheduler's step log gives it
            else:
                reason = req.emit(step if rng.random() < 0.5 else np.asarray(step), 1.0)
                req.unsent()
            assert reason == want_reason and req.output == want and len(req.token_times) == len(want)
            assert all(type(t) is int for t in req.output)
        assert req.stop_reason == (want[-1] if reason == "stop" else None)


def test_metrics_match_their_definitions():
    rng = random.Random(1)
    for _ in range(50):
        req = Request("r", [1], e3.SamplingParams(), 64, arrival=0.0)
        depths = [rng.choice([0, 3, 4]) for _ in range(rng.randint(0, 20))]
        for depth in depths:
            req.record_step(rng.randint(1, depth + 1), depth, 3 if depth else 0)
        req.token_times = sorted(rng.random() for _ in range(len(depths) + 1))
        got = req.metrics(2.0, max_depth=4)
        acc, drafted = np.asarray(req.accept_lengths, np.int64), np.asarray(depths, np.int64)
        per_position = [float(np.mean(acc[drafted >= d] - 1 >= d)) if np.any(drafted >= d) else 0.0
                        for d in range(1, 5)]
        assert got["per_position_acceptance"] == per_position
        assert got["mean_accept_length"] == (float(acc.mean()) if acc.size else 1.0)
        assert got["num_accepted_tokens"] == int(np.maximum(acc[drafted > 0] - 1, 0).sum())
        assert got["num_draft_tokens"] == int(drafted.sum()) and got["num_target_passes"] == len(depths) + 1
        assert got["itl_s"] == [float(x) for x in np.diff(req.token_times)]


def test_scheduler_counters_match_their_definitions():
    from eagle3_jax.scheduler.metrics import SchedulerCounters

    rng = np.random.default_rng(0)
    for max_accept in (0, 1, 3, 7):
        counters, steps = SchedulerCounters(max_accept), []
        for _ in range(40):
            depth = int(rng.integers(0, max_accept + 1))
            counts = rng.integers(1, depth + 2, int(rng.integers(1, 9))).astype(np.int32)
            counters.decode_step(counts, depth)
            steps.append((counts, depth))
        drafted = [(c, d) for c, d in steps if d]
        got = counters.stats()
        assert got["accepted_tokens_total"] == sum(int(c.sum()) for c, _ in steps)
        assert got["num_decode_steps_total"] == sum(len(c) for c, _ in steps)
        assert got["num_drafts_total"] == sum(len(c) for c, _ in drafted)
        assert got["num_draft_tokens_total"] == sum(len(c) * d for c, d in drafted)
        assert got["num_accepted_draft_tokens_total"] == sum(int((c - 1).sum()) for c, _ in drafted)
        assert got["per_position_accepted_total"] == [sum(int((c - 1 >= d).sum()) for c, _ in drafted)
                                                      for d in range(1, max_accept + 1)]
        assert got["per_position_drafted_total"] == [sum(len(c) for c, dd in drafted if dd >= d)
                                                     for d in range(1, max_accept + 1)]


def test_an_outputs_metrics_are_computed_once_when_read():
    req = Request("r", [1], e3.SamplingParams(), 8, arrival=0.0)
    req.emit([5], 1.0)
    req.emit([6], 1.5, timed=False)
    req.record_steps([1], [0], [1.5], 0)
    req.finish_reason = "length"
    out = req.output_record(2.0, max_depth=2)
    first = out.metrics
    assert first == req.metrics(2.0, max_depth=2) and out.metrics is first and first["e2e_latency_s"] == 2.0
    assert first["itl_s"] == [0.5]


def test_a_step_logs_times_cover_the_emitted_tokens_only():
    req = Request("r", [1], e3.SamplingParams(stop_token_ids=(2,)), 8)
    req.emit([5], 1.0)  # a prefill's first token, timed as it is emitted
    req.unsent()  # handed out
    req.take([6, 7])  # a decode step's, timed by the step log
    assert req.emit([8, 2, 9], 2.0, timed=False) == "stop"  # the 9 is dropped
    req.record_steps([2, 3], [3, 3], [1.5, 2.0], 4)
    assert req.output == [5, 6, 7, 8, 2] and req.token_times == [1.0, 1.5, 1.5, 2.0, 2.0]
    assert req.accept_lengths == [2, 3] and req.draft_passes == 4
