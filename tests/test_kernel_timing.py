"""The kernel benchmark's library (eagle3_jax.bench.kernel_timing, attention_timing, moe_timing):
its flags' parsing, the input sets a timed program rotates over, a row's figures and table line,
the random inputs, and the row loops, with the kernels swapped for stand-ins (the XLA reference,
a wrong answer, a launch that does not compile) so that no kernel runs here.
(tests/test_triton_attention.py runs scripts/bench_kernels.py with the real kernels, interpreted.)"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.bench import attention_timing as at
from eagle3_jax.bench import kernel_timing as kt
from eagle3_jax.bench import moe_timing as mt
from eagle3_jax.planning.memory import DEVICES
from eagle3_jax.weights.quant import QArray

H200 = DEVICES["H200"]


def test_list_flags_parse_to_positive_integers():
    assert kt.parse_counts(["1", "16", "64"], "batches") == (1, 16, 64)
    with pytest.raises(ValueError, match=r"--tokens must be comma-separated integers; got '1,x'"):
        kt.parse_counts(["1", "x"], "tokens")
    with pytest.raises(ValueError, match="--contexts needs positive integers"):
        kt.parse_counts(["8", "0"], "contexts")
    with pytest.raises(ValueError, match="--contexts needs positive integers"):
        kt.parse_counts([], "contexts")


def test_attention_launches_parse_and_are_checked():
    launch = at.parse_launch("32:8:2:64")
    assert (launch.block_rows, launch.num_warps, launch.num_stages, launch.block_slots) == (32, 8, 2, 64)
    assert (launch.row_parts, at.parse_launch("64:8:1:16:2").row_parts) == (1, 2)
    with pytest.raises(ValueError, match="is not block_rows:num_warps:num_stages:block_slots"):
        at.parse_launch("32:8:2")
    with pytest.raises(ValueError, match="is not block_rows"):
        at.parse_launch("64:8:1:16:2:2")
    # rows < 16, not powers of two, no warps, row parts not a power of two
    for text in ("8:4:1:16", "48:4:1:16", "32:0:1:16", "32:4:1:24", "64:8:1:16:3"):
        with pytest.raises(ValueError, match="needs block_rows a power of two"):
            at.parse_launch(text)


def test_a_timed_program_reads_about_rotate_bytes():
    quarter = kt.ROTATE_BYTES // 4
    assert kt.input_sets(quarter, interpret=False) == 4
    assert kt.input_sets(quarter + 1, interpret=False) == 4  # 3 sets would read less than ROTATE_BYTES
    assert kt.input_sets(quarter - 1, interpret=False) == 5
    assert kt.input_sets(2 * kt.ROTATE_BYTES, interpret=False) == 1
    assert kt.input_sets(1000, interpret=False) == kt.input_sets(0, interpret=False) == kt.MAX_SETS
    assert kt.input_sets(1000, interpret=True) == 1


def test_a_rows_figures_are_fractions_of_the_peaks():
    row = kt.timing(k_ms=2.0, x_ms=4.0, read=8e6, flops=4e9, peak=8.0, peak_tflops=4.0)
    assert row["kernel_gbps"] == pytest.approx(4.0) and row["xla_gbps"] == pytest.approx(2.0)
    assert row["peak_fraction"] == pytest.approx(0.5) and row["xla_peak_fraction"] == pytest.approx(0.25)
    assert row["flops_fraction"] == pytest.approx(0.5)  # 4 GFLOP in 2 ms: 2 TFLOP/s of 4
    assert kt.timing(2.0, 4.0, 8e6, 4e9, 8.0, 0.0)["flops_fraction"] is None
    # the roofline: 8 MB at 8 GB/s is 1 ms, 4 GFLOP at 4 TFLOP/s 1 ms: compute binds past that
    assert row["roofline_ms"] == pytest.approx(1.0) and row["roofline_fraction"] == pytest.approx(0.5)
    assert row["xla_roofline_fraction"] == pytest.approx(0.25)
    assert kt.timing(2.0, 4.0, 8e6, 8e9, 8.0, 4.0)["roofline_bound"] == "compute"
    assert kt.timing(2.0, 4.0, 8e6, 8e9, 8.0, 4.0)["roofline_fraction"] == pytest.approx(1.0)
    assert kt.timing(2.0, 4.0, 16e6, 4e9, 8.0, 0.0)["roofline_bound"] == "bandwidth"  # no matrix peak known
    measured = kt.with_measured_fractions(dict(row), {"copy_gbps": 16.0, "matmul_tflops": 1.0})
    assert measured["measured_copy_fraction"] == pytest.approx(0.25)
    assert measured["xla_measured_copy_fraction"] == pytest.approx(0.125)
    assert measured["measured_flops_fraction"] == pytest.approx(2.0)
    failed = {"op": "attention", "error": "no", "equal": None}
    assert kt.with_measured_fractions(dict(failed), {"copy_gbps": 1.0, "matmul_tflops": 1.0}) == failed
    assert kt.with_measured_fractions(dict(row), None) == row


def test_a_rows_line():
    row = dict(kt.timing(2.0, 4.0, 8e6, 4e9, 8.0, 4.0), equal=True)
    assert kt.row_line([1, 4], row, 0.001) == "| 1 | 4 | 2.0000 | 4.0000 | 2.00x | 8.0 | 4.0 | 50.0 | 0.001 |"
    assert kt.row_line([1], dict(row, equal=False), 0.5).endswith("| 0.5 DIFFERS |")
    assert kt.ceilings_line({"copy_gbps": 4012.4, "matmul_tflops": 701.6}) == (
        "ceilings measured: copy 4012 GB/s (read + written), bf16 matmul 702 TFLOP/s")


def test_the_record_holds_the_rows():
    record = kt.kernel_record(["bench_kernels.py", "--ops=moe"], True, [{"op": "moe"}])
    assert record["argv"] == ["bench_kernels.py", "--ops=moe"] and record["rows"] == [{"op": "moe"}]
    assert record["interpret"] and record["device"] == "cpu" and set(record) >= {"date", "jax", "machine"}


def _shapes(**changes) -> at.AttentionShapes:
    base = dict(kind="mla", heads=2, kv_heads=2, head_dim=16, latent=16, rope=8, page_size=16, num_splits=0,
                dtype="float32", batches=(1,), tokens=(1, 2), contexts=(20,), repeats=1)
    return at.AttentionShapes(**dict(base, **changes))


def test_attention_bytes_and_flops():
    mla = _shapes(latent=512, rope=64, heads=8, dtype="bfloat16")
    assert at.attention_bytes(mla, batch=2, context=100) == 2 * 100 * 576 * 2
    assert at.attention_flops(mla, batch=2, t=4, context=100) == 2 * 2 * 8 * 4 * 100 * (1024 + 64)
    gqa = _shapes(kind="gqa", heads=48, kv_heads=8, head_dim=128)
    assert at.attention_bytes(gqa, batch=2, context=100) == 2 * 2 * 100 * 8 * 128 * 4
    assert at.attention_flops(gqa, batch=2, t=4, context=100) == 2 * 2 * 48 * 4 * 100 * 256


def test_attention_inputs_give_each_set_its_own_pages():
    rng = np.random.default_rng(0)
    (q, k, v, tables, lengths, q2, k2), read = at.attention_case(_shapes(), batch=2, t=3, context=40, rng=rng, sets=3)
    assert tables.shape == (3, 2, 3)  # sets, batch, ceil(40 / 16) pages per row
    assert sorted(tables.ravel().tolist()) == list(range(1, 19))  # every page once; page 0 unused
    assert q.shape == (2, 1, 6, 16) and q2.shape == (2, 1, 6, 8) and v is None  # MLA: heads x T rows
    assert k.shape == (1, 19, 16, 1, 16) and k2.shape == (1, 19, 16, 1, 8)
    assert lengths.tolist() == [40, 40] and read == 2 * 40 * 24 * 4
    gqa = _shapes(kind="gqa", heads=4, kv_heads=2)
    (q, k, v, tables, _, q2, k2), _ = at.attention_case(gqa, batch=1, t=3, context=16, rng=rng)
    assert q.shape == (1, 2, 6, 16) and k.shape == v.shape == (1, 2, 16, 2, 16) and q2 is k2 is None


def test_attention_shapes_from_the_flags():
    values = types.SimpleNamespace(kind="gqa", heads=8, kv_heads=2, head_dim=64, latent=512, rope=64, page_size=16,
                                   num_splits=0, dtype="bfloat16", batches=["1", "4"], tokens=["1"],
                                   contexts=["64"], attention_launches=["32:8:2:32"], repeats=3)
    shapes = at.attention_shapes(values)
    assert shapes.batches == (1, 4) and shapes.launches == ("32:8:2:32",) and shapes.repeats == 3
    with pytest.raises(ValueError, match="--contexts"):
        at.attention_shapes(types.SimpleNamespace(**dict(vars(values), contexts=["a"])))
    with pytest.raises(ValueError, match="--attention_launches: '32:8' is not"):
        at.attention_shapes(types.SimpleNamespace(**dict(vars(values), attention_launches=["32:8"])))


def _reference_kernel(offset: float = 0.0, refuse=lambda launch: False):
    """A stand-in for paged_prefix_attention: the reference (+ offset), raising for launches `refuse` names."""
    def kernel(q, k_pool, v_pool, layer, block_table, lengths, *, scale, launch=None, **kwargs):
        if refuse(launch):
            raise RuntimeError("triton: out of shared memory\n- needs 300 KB\nline 3\nline 4")
        out, lse = at.paged_prefix_attention_reference(q, k_pool, v_pool, layer, block_table, lengths, scale=scale,
                                                       **kwargs)
        return out + offset, lse
    return kernel


def test_attention_rows_time_each_launch_and_record_one_that_does_not_compile(monkeypatch):
    refuse = _reference_kernel(refuse=lambda launch: launch is not None and launch.block_rows == 64)
    monkeypatch.setattr(at, "paged_prefix_attention", refuse)
    seen, lines = [], []
    rows = at.attention_rows(_shapes(launches=("64:4:1:16", "16:4:1:16")), H200, True, seen.append, lines.append)
    assert seen == rows and [(r["tokens"], r["launch"]) for r in rows] == [
        (t, launch) for t in (1, 2) for launch in ("table", "64:4:1:16", "16:4:1:16")]
    timed = [r for r in rows if r["launch"] != "64:4:1:16"]
    assert all(r["equal"] is True and r["max_abs_err"] == 0.0 and r["kernel_ms"] > 0 for r in timed)
    assert all(r["bytes_read"] == 20 * 24 * 4 and r["input_sets"] == 1 for r in timed)
    refused = [r for r in rows if r["launch"] == "64:4:1:16"]
    assert all(r["equal"] is None and "kernel_ms" not in r for r in refused)
    assert refused[0]["error"] == "triton: out of shared memory needs 300 KB [2 more lines]"
    assert len(lines) == 3 + len(rows) and "% of H200 peak" in lines[1] and "| launch |" in lines[1]
    assert "Triton's interpreter" in lines[0] and "64:4:1:16: does not compile (triton: out of" in lines[4]
    assert lines[3].startswith("| 1 | 1 | 20 |") and lines[3].split(" | ")[5] == "table"


def test_attention_rows_mark_a_kernel_that_differs_and_raise_when_the_tables_launch_fails(monkeypatch):
    monkeypatch.setattr(at, "paged_prefix_attention", _reference_kernel(offset=0.5))
    lines = []
    rows = at.attention_rows(_shapes(tokens=(1,)), H200, True, echo=lines.append)
    assert rows[0]["equal"] is False and rows[0]["max_abs_err"] == pytest.approx(0.5)
    assert lines[-1].endswith("DIFFERS |") and "| launch |" not in lines[1]
    monkeypatch.setattr(at, "paged_prefix_attention", _reference_kernel(refuse=lambda launch: launch is None))
    with pytest.raises(RuntimeError, match="out of shared memory"):  # the launch table's own failing: a bug, not a row
        at.attention_rows(_shapes(tokens=(1,), launches=("16:4:1:16",)), H200, True)


@pytest.mark.parametrize("fmt, values, scales", [
    ("int4", ("uint8", (2, 32, 32)), ("bfloat16", (2, 2, 32))),
    ("w4a8", ("uint8", (2, 32, 32)), ("bfloat16", (2, 2, 32))),
    ("mxfp4", ("uint8", (2, 32, 32)), ("uint8", (2, 2, 32))),
    ("fp8_block", ("float8_e4m3fn", (2, 64, 32)), ("float32", (2, 1, 1))),
    ("fp8_channel", ("float8_e4m3fn", (2, 64, 32)), ("float32", (2, 1, 32))),
])
def test_expert_weights_in_each_format(fmt, values, scales):
    w = mt.expert_weight(np.random.default_rng(0), fmt, 2, 64, 32)
    assert isinstance(w, QArray) and w.shape == (2, 64, 32)
    assert (str(w.values.dtype), w.values.shape) == values and (str(w.scales.dtype), w.scales.shape) == scales
    assert (w.qformat.act == "int8") == (fmt == "w4a8")
    assert np.isfinite(np.asarray(w.values.astype(jnp.float32))).all()  # float8: no NaN byte drawn
    dense = mt.expert_weight(np.random.default_rng(0), "bfloat16", 2, 64, 32)
    assert dense.dtype == jnp.bfloat16 and dense.shape == (2, 64, 32)


def _moe(**changes) -> mt.MoeShapes:
    base = dict(hidden=32, inter=32, experts=8, local_experts=4, topk=2, fmt="bfloat16", tokens=(3, 5), repeats=1)
    return mt.MoeShapes(**dict(base, **changes))


def test_moe_shapes_and_weights_the_kernels_refuse():
    values = types.SimpleNamespace(moe_tokens=["1", "8"], hidden=64, moe_inter=64, experts=16, local_experts=4,
                                   topk=2, moe_format="int4", dtype="bfloat16", repeats=1)
    assert mt.moe_shapes(values) == _moe(hidden=64, inter=64, experts=16, fmt="int4", tokens=(1, 8))
    with pytest.raises(ValueError, match="must not exceed --experts"):
        mt.moe_shapes(types.SimpleNamespace(**dict(vars(values), local_experts=17)))
    with pytest.raises(ValueError, match="must not exceed --experts"):
        mt.moe_shapes(types.SimpleNamespace(**dict(vars(values), topk=17)))
    gate, up, down = mt.expert_weights(_moe(fmt="int4", hidden=64))
    assert gate.shape == up.shape == (4, 64, 32) and down.shape == (4, 32, 64)
    with pytest.raises(ValueError, match="cannot take these shapes .*pick --hidden / --moe_inter"):
        mt.expert_weights(_moe(fmt="int4", hidden=48))  # int4 groups of 32 along K = 48


def test_experts_hit_and_errors():
    ids = np.array([[0, 5], [3, 0], [7, 6]])
    assert mt.experts_hit(ids, 4) == 2 and mt.local_assignments(ids, 4) == 3
    assert mt.max_rel_err(jnp.array([1.0, 2.5]), jnp.array([1.0, 2.0])) == pytest.approx(0.25)
    assert np.isnan(mt.max_rel_err(jnp.array([np.nan, 1.0]), jnp.array([1.0, 1.0])))
    assert kt.max_abs_err(jnp.array([1.0, 3.0]), jnp.array([1.5, 2.0])) == pytest.approx(1.0)


def test_moe_rows_count_what_the_local_experts_read(monkeypatch):
    real = mt.local_experts

    def kernel(x, weights, ids, *ws, use_kernels=False):  # the kernel path: XLA's answer, 1 % off, or doubled
        out = real(x, weights, ids, *ws, use_kernels=False)
        return out * (scale if use_kernels else 1.0)

    monkeypatch.setattr(mt, "local_experts", kernel)
    ws = mt.expert_weights(_moe())
    # other token counts for the second stand-in: jit keeps the first one's trace for the same shapes
    for scale, equal, tokens in ((1.01, True, (3, 5)), (2.0, False, (4, 6))):
        shapes = _moe(tokens=tokens)
        seen, lines = [], []
        rows = mt.moe_rows(shapes, ws, H200, True, seen.append, lines.append)
        assert seen == rows and [r["tokens"] for r in rows] == list(tokens)
        for row in rows:
            assert row["equal"] is equal and row["max_rel_err"] == pytest.approx(scale - 1.0, rel=1e-2)
            assert row["bytes_read"] == row["experts_hit"] * 3 * 32 * 32 * 2 + row["tokens"] * 32 * 2
            assert row["flops"] == 6 * 32 * 32 * row["local_assignments"] and row["input_sets"] == 1
            assert row["experts_hit"] <= min(4, row["local_assignments"])
            assert row["local_assignments"] <= 2 * row["tokens"]  # top-2
        assert len(lines) == 5 and lines[0].startswith("\nrouted experts: 4 of 8 on the device, top-2, 32 -> 32 -> 32")
        assert lines[3].startswith(f"| {tokens[0]} | {rows[0]['local_assignments']} | {rows[0]['experts_hit']} | 1 |")
        assert lines[3].endswith("DIFFERS |") is not equal
