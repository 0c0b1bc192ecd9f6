"""The scheduler's per-slot host tables and the packed arguments a step program takes."""

import jax
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.sampling.sampler import GREEDY_BATCH, BatchFeatures, SamplingArrays, packed_settings, unpack_settings
from eagle3_jax.scheduler.slot_table import BULK_STOP_IDS, LOGGED_STEPS, SlotTable, chunk_columns, prefill_chunks

SETTINGS = [e3.SamplingParams(), e3.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2**32 - 1),
            e3.SamplingParams(min_tokens=3, stop_token_ids=(2, 7), presence_penalty=-1.5, frequency_penalty=0.25,
                              repetition_penalty=1.3, seed=12345),
            e3.SamplingParams(stop_token_ids=(9,), synthetic_acceptance=(0.9, 0.5))]


def _fields(arrays: SamplingArrays) -> dict:
    return {name: None if value is None else np.asarray(value) for name, value in vars(arrays).items()}


def _reference(params: list) -> dict:
    """Each field of a batch's SamplingArrays, written out from the SamplingParams."""
    stop_ids = np.full((len(params), 16), -1, np.int32)
    profile = np.full((len(params), 16), -1.0, np.float32)
    for i, p in enumerate(params):
        if p.min_tokens:
            stop_ids[i, : len(p.stop_token_ids)] = p.stop_token_ids
        if p.synthetic_acceptance is not None:
            profile[i] = 0.0
            profile[i, : len(p.synthetic_acceptance)] = p.synthetic_acceptance
    column = lambda name, dtype: np.asarray([getattr(p, name) for p in params], dtype)  # noqa: E731
    return {"temperature": column("temperature", np.float32), "top_k": column("top_k", np.int32),
            "top_p": column("top_p", np.float32), "seed": column("seed", np.uint32),
            "min_tokens": column("min_tokens", np.int32), "stop_ids": stop_ids,
            "presence_penalty": column("presence_penalty", np.float32),
            "frequency_penalty": column("frequency_penalty", np.float32),
            "repetition_penalty": column("repetition_penalty", np.float32), "accept_profile": profile,
            "sampled": np.asarray(any(p.temperature > 0 for p in params))}


@pytest.mark.parametrize("traced", [False, True])
def test_packed_settings_read_back_as_the_batch_arrays(traced):
    ints, floats = (np.stack(column) for column in zip(*(packed_settings(p) for p in SETTINGS)))
    unpack = jax.jit(unpack_settings, static_argnums=2) if traced else unpack_settings
    got, want = _fields(unpack(ints, floats, BatchFeatures(synthetic=True))), _reference(SETTINGS)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].dtype == want[name].dtype, name
    assert unpack(ints, floats, BatchFeatures()).accept_profile is None
    greedy = unpack(ints, floats, GREEDY_BATCH)  # the settings a batch does not use are left out
    assert not greedy.sampled and greedy.min_tokens is greedy.stop_ids is greedy.repetition_penalty is None
    assert greedy.top_k is greedy.top_p is None  # no sampled row keeps a top-k or top-p
    assert SamplingArrays.from_params(SETTINGS[:2], 3).accept_profile is None  # no row with a profile
    np.testing.assert_array_equal(SamplingArrays.from_params(SETTINGS, 5).top_p, [*want["top_p"], 1.0])


def test_rows_gather_slots_settings_and_pages_and_leave_the_scratch_slot_alone():
    table = SlotTable(5, max_pages_per_seq=8)
    scratch = table.ints[4].copy(), table.floats[4].copy()
    table.admit(1, 11, SETTINGS[1])
    table.set_pages(1, 0, [3, 4])
    table.set_pages(1, 2, [9])
    table.admit(3, 2, SETTINGS[2])
    rows = table.rows(np.asarray([3, 1, 4, 4]), 4)
    assert rows.ints.shape == (4, rows.ints.shape[1]) and rows.block_table.shape == (4, 4)
    np.testing.assert_array_equal(rows.slots, [3, 1, 4, 4])
    np.testing.assert_array_equal(rows.prompt_lens, [2, 11, 0, 0])
    np.testing.assert_array_equal(rows.block_table[1], [3, 4, 9, kv_cache.SCRATCH_PAGE])
    assert (rows.block_table[[0, 2, 3]] == kv_cache.SCRATCH_PAGE).all()
    sp = _fields(rows.sampling)
    want = _reference([SETTINGS[2], SETTINGS[1], e3.SamplingParams(), e3.SamplingParams()])
    for name in ("temperature", "top_k", "top_p", "seed", "min_tokens", "stop_ids", "repetition_penalty"):
        np.testing.assert_array_equal(sp[name], want[name], err_msg=name)
    # The features its rows use (sampled, min_tokens, penalties; no synthetic profile), and only those.
    assert rows.features == BatchFeatures(synthetic=False) and rows.key == (rows.ints.shape, rows.features)
    assert table.rows(np.asarray([1, 4]), 4).features == BatchFeatures(holds_back=False, penalized=False)
    assert table.rows(np.asarray([4, 4]), 4).features == GREEDY_BATCH
    table.admit(0, 3, SETTINGS[3])
    assert table.rows(np.asarray([0, 4]), 4).features == BatchFeatures(sampled=False, holds_back=False,
                                                                       penalized=False, synthetic=True, truncated=False)
    table.clear(0)
    np.testing.assert_array_equal(table.num_pages, [0, 3, 0, 0, 0])
    generations = table.generation.copy()
    table.clear(1)
    np.testing.assert_array_equal(table.num_pages, [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(table.generation - generations, [0, 1, 0, 0, 0])  # launched rows of slot 1: void
    np.testing.assert_array_equal(table.ints[1, 1:], scratch[0][1:])  # all but the slot's own index
    np.testing.assert_array_equal(table.floats[1], scratch[1])
    np.testing.assert_array_equal(table.ints[4], scratch[0])


@pytest.mark.parametrize("others", [0, 10], ids=["few rows", "many rows"])  # FEW_ROWS: scalar or numpy updates
def test_step_logs_advance_lengths_fill_up_and_start_afresh_when_taken(others):
    table = SlotTable(16, max_pages_per_seq=8)
    table.admit(0, 5, SETTINGS[0], length=16, reserve=(4, 5))
    table.admit(2, 7, SETTINGS[1])
    table.length[2] = 7  # its prefill ran
    extra = list(range(4, 4 + others))  # slots that step every time
    rng = np.random.default_rng(0)
    want = {s: ([], [], []) for s in [0, 2, *extra]}  # (tokens committed, drafted, times) of each step
    taken = {s: ([], [], []) for s in want}
    for step in range(2 * LOGGED_STEPS + 3):
        slots = np.asarray(([2, 0] if step % 3 else [0]) + extra)  # slot 2 skips every third step
        counts = rng.integers(1, 5, len(slots))
        table.pending[slots] += 1  # launched, then read
        depth = step % 4
        full = table.log_steps(slots, counts, depth, 2 * depth, float(step))
        for slot, count in zip(slots.tolist(), counts.tolist()):
            want[slot][0].append(count)
            want[slot][1].append(depth)
            want[slot][2].append(float(step))
        for i in full.tolist():  # as the scheduler does: a full log is taken after the step
            accepted, drafted, times, _ = table.take_steps(int(slots[i]))
            assert len(accepted) == LOGGED_STEPS
            for got, log in zip((accepted, drafted, times), taken[int(slots[i])]):
                log.extend(got)
    for slot in want:
        *rest, passes = table.take_steps(slot)
        assert [t + r for t, r in zip(taken[slot], rest)] == list(want[slot])
        assert table.length[slot] == {0: 16, 2: 7}.get(slot, 0) + sum(want[slot][0]) and table.pending[slot] == 0
        assert passes == 2 * sum(want[slot][1]) - 2 * sum(taken[slot][1])  # since the last take
        assert table.take_steps(slot) == ([], [], [], 0)  # afresh
    table.log_steps(np.asarray([0]), np.asarray([3]), 2, 1, 9.0)
    table.clear(0)
    assert table.take_steps(0) == ([], [], [], 0) and table.length[0] == 0 and table.pending[0] == 0


@pytest.mark.parametrize("rows", [3, 12], ids=["few rows", "many rows"])
def test_short_of_pages_finds_the_rows_whose_next_step_outgrows_their_pages(rows):
    table, rng = SlotTable(16, max_pages_per_seq=8), np.random.default_rng(rows)
    slots = rng.permutation(15)[:rows].tolist()
    for slot in slots:
        table.admit(slot, 3, SETTINGS[0], length=int(rng.integers(0, 60)), reserve=(4, 5))
        table.set_pages(slot, 0, list(range(1, 1 + int(rng.integers(1, 6)))))
        table.pending[slot] = rng.integers(0, 3)
    table.length[slots[-1]] = 16 * table.num_pages[slots[-1]]  # one at least is short
    ends = [int(table.length[s] + 4 * table.pending[s] + 5) for s in slots]
    short, needed = table.short_of_pages(slots, page_size=16)
    assert short == [i for i, s in enumerate(slots) if ends[i] > 16 * table.num_pages[s]] and short
    assert needed == [ends[i] for i in short]


@pytest.mark.parametrize("rows", [3, 40], ids=["few rows", "many rows"])
def test_bulk_rows_are_those_whose_tokens_end_nothing_and_nothing_reads_one_by_one(rows):
    """A step's tokens go out whole exactly when the request reads no token one by one, none of
    them is one of its stop ids and they leave room in its budget; a request with more stop ids
    than the table holds never goes out whole. Its output is committed length - prompt + 1 long."""
    table, rng = SlotTable(64, max_pages_per_seq=8), np.random.default_rng(rows)
    decided = []
    for _ in range(12):
        slots = rng.permutation(63)[:rows]
        room, stops, reads = {}, {}, {}
        for slot in slots.tolist():
            stops[slot] = tuple(rng.choice(12, int(rng.integers(0, 3)), replace=False).tolist())
            if rng.random() < 0.1:
                stops[slot] = tuple(range(100, 100 + BULK_STOP_IDS + 1))  # too many to hold
            prompt, output, budget = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(6, 12))
            reads[slot] = bool(rng.random() < 0.2)
            table.admit(slot, prompt, e3.SamplingParams(stop_token_ids=stops[slot]), budget=budget,
                        reads_tokens=reads[slot], length=prompt + output - 1)
            room[slot] = budget - output
        counts, tokens = rng.integers(1, 5, rows), rng.integers(0, 12, (rows, 5))
        got = table.bulk_rows(slots, tokens, counts)
        want = [not reads[s] and len(stops[s]) <= BULK_STOP_IDS and k < room[s] and not set(t[:k]) & set(stops[s])
                for s, t, k in zip(slots.tolist(), tokens.tolist(), counts.tolist())]
        assert got == want and all(type(b) is bool for b in got)
        decided += got
    assert any(decided) and not all(decided)
    table.clear(int(slots[0]))
    assert table.bulk_rows(slots[:1], tokens[:1], counts[:1]) == [False]


def test_prefill_chunks_are_padding_rows_until_written_through_their_columns():
    packed = prefill_chunks(2, 16)
    tokens, lengths, n_valid, following, counter = chunk_columns(packed)
    assert tokens.shape == (2, 16) and list(n_valid) == [1, 1] and list(following) == [-1, -1]
    tokens[0, :3] = [5, 6, 7]
    lengths[0], n_valid[0], following[0], counter[0] = 32, 3, 8, 2
    again = chunk_columns(packed)
    assert list(again[0][0, :4]) == [5, 6, 7, 0] and (again[1][0], again[2][0], again[3][0], again[4][0]) == (32, 3, 8, 2)
