"""What scripts/plan.py prints (eagle3_jax/planning/report.py), from hand-made specs, plans and step
costs: no compile, no model folder."""

from __future__ import annotations

import pytest

from eagle3_jax.planning import report
from eagle3_jax.planning.memory import Device, MemoryPlan
from eagle3_jax.planning.roofline import Hardware, Prediction, StepCosts, predict
from eagle3_jax.spec_decode.settings import SpecConfig
from eagle3_jax.weights.params import ParamSpec


def test_meshes_parse_from_commas_or_x_and_refuse_anything_else():
    assert report.parse_meshes("1,1,8;1x2x4") == [(1, 1, 8), (1, 2, 4)]
    for bad in ("1,2", "1,0,8", "1,1,8;", "a,b,c", "1,1,-8"):
        with pytest.raises(ValueError, match="is not data,tensor,expert"):
            report.parse_meshes(bad)


def test_dividing_sizes_are_the_nearest_below_and_above():
    assert report.dividing_sizes(3, [8, 16]) == [2, 4]
    assert report.dividing_sizes(8, [12]) == [6, 12]
    assert report.dividing_sizes(5, [7]) == [7]  # none below: 1 splits nothing
    assert report.dividing_sizes(4, [7919]) == []  # a prime beyond 4 x 4


SPECS = {
    "w": ParamSpec((6, 10), ("embed", "mlp")),  # mlp=10: 4 does not divide it
    "e": ParamSpec((12, 6), ("vocab", "embed")),  # vocab=12: 4 divides it
    "q": ParamSpec((8, 10), ("q_heads", "mlp")),  # the tensor axis already splits q_heads: mlp stays whole
    "x": ParamSpec((8, 4, 6), ("experts", "embed", "expert_mlp")),  # expert axis 1: only expert_mlp=6 counts
}


def test_undivided_names_each_dimension_an_axis_cannot_split_and_the_bytes_replicated():
    # bfloat16: w is 120 bytes, 90 more per device than a 4-way split; x is 384, 288 more
    assert report.undivided(SPECS, (1, 4, 1), "bfloat16") == {
        ("tensor", "mlp", 10): [("w", 90)], ("tensor", "expert_mlp", 6): [("x", 288)]}
    assert report.undivided(SPECS, (1, 2, 1), "bfloat16") == {}
    assert report.undivided(SPECS, (1, 1, 3), "bfloat16") == {("expert", "experts", 8): [("x", 256)]}
    # experts over data x expert: 3 x 2 does not divide 8, expert alone does, the data axis replicates them
    assert report.undivided(SPECS, (3, 1, 2), "bfloat16") == {("data", "experts", 8): [("x", 256)]}
    assert report.undivided(SPECS, (2, 1, 4), "bfloat16") == {}


def test_replication_notes_say_what_stays_whole_and_which_meshes_divide():
    assert report.replication_notes(SPECS, (1, 4, 1), "bfloat16", 1, "B") == [
        "mesh 1,4,1: the tensor axis (4) does not divide mlp=10 (1 tensors, e.g. w), expert_mlp=6 (1 tensors, e.g. x); "
        "they are replicated on every device instead of split 4 ways, 378.0 B more per device. Meshes that divide: "
        "1,2,1"]
    assert report.replication_notes(SPECS, (1, 2, 1), "bfloat16", 1, "B") == []


def _plan(argument_bytes=70, temp_bytes=50, weight_bytes=40, kv_bytes=20) -> MemoryPlan:
    return MemoryPlan(mesh_shape={"data": 1, "tensor": 1, "expert": 8}, batch=4, max_len=16, spec=None,
                      argument_bytes=argument_bytes, temp_bytes=temp_bytes, output_bytes=0, alias_bytes=0,
                      weight_bytes=weight_bytes, kv_bytes=kv_bytes, kv_bytes_per_token=8,
                      step_read_bytes=2_000_000, programs={})


SMALL = Device("SMALL", hbm_bytes=100, hbm_gbps=1.0, bf16_tflops=1.0)
BIG = Device("BIG", hbm_bytes=1000, hbm_gbps=2.0, bf16_tflops=1.0)


def test_over_note_says_by_how_much_and_of_what():
    assert report.over_note(_plan(), BIG, 1, "B") is None
    assert report.over_note(_plan(), SMALL, 1, "B") == (
        "mesh 1,1,8, batch 4, SMALL: NO, needs 120.0 B of 100.0, 20.0 over "
        "(weights 40.0, KV 20.00, other arguments 10.00, temps 50.0)")
    # arguments that are only weights and KV name no "other arguments"
    assert report.over_note(_plan(argument_bytes=60), SMALL, 1, "B") == (
        "mesh 1,1,8, batch 4, SMALL: NO, needs 110.0 B of 100.0, 10.0 over (weights 40.0, KV 20.00, temps 50.0)")


def test_memory_table_lines():
    assert report.memory_head([SMALL, BIG]) == [
        "| mesh d,t,e | batch | arguments | temps | args+temps | weights | KV | read/step | "
        "SMALL fits / KV tok left / TPOT ms | BIG fits / KV tok left / TPOT ms |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    # SMALL: 120 > 100 bytes, nothing left, 2e6 bytes at 1 GB/s = 2 ms, / tau 2; BIG: (1000 - 120) // 8 tokens left
    assert report.memory_row((1, 1, 8), _plan(), [SMALL, BIG], 10, 2.0) == (
        "| 1,1,8 | 4 | 7.0 | 5.0 | 12.0 | 4.0 | 2.00 | 200000.00 | NO / 0 / 1.00 | yes / 110 / 0.50 |")


def test_title_names_what_is_planned_and_the_program_path():
    settings = report.PlanSettings("t", "d", SpecConfig(3, 1, 4), 2304)
    assert settings.title(1.0, "GiB", memory=True) == (
        "target t, draft d, spec chain:3:1:4, max_len 2304, quant auto, tau 1.0 (GiB per device); program: the XLA path")
    kernels = report.PlanSettings("t", None, None, 16, quant="w4a8", kernels="triton", arch="gfx942")
    assert kernels.title(2.5, "MiB", memory=True) == (
        "target t, max_len 16, quant w4a8, tau 2.5 (MiB per device); program: Triton kernels (triton) on gfx942, "
        "each as an op of its output shapes")
    assert kernels.title(2.5, "MiB", memory=False) == "target t, max_len 16, quant w4a8"


def test_milliseconds_keep_three_digits_below_one():
    assert [report.format_ms(x) for x in (12.345, 1.0, 0.5, 0.0012345)] == ["12.35", "1.00", "0.5", "0.00123"]


def test_prediction_line_reads_the_prediction():
    p = Prediction(concurrency=2, plain_step_ms=4.0, spec_step_ms=6.0, tau=3.0, verify_ms=5.0, draft_ms=0.5,
                   verify_bound="memory")
    assert report.prediction_line(p, fits=True) == "| 2 | 4.00 | 500 | 6.00 (5.00 + 0.5) | 2.00 | 1,000 | 2.00x | memory | yes |"
    assert report.prediction_line(p, fits=False).endswith("| memory | NO |")


COSTS = StepCosts(dense_bytes=10**9, expert_bytes=4 * 10**9, dense_elements=5 * 10**8, expert_elements=2 * 10**9,
                  num_experts=64, experts_per_token=4, data_shards=1, kv_bytes_per_token=10**5,
                  attention_flops_per_key=10**4, draft_bytes=10**8, draft_head_bytes=10**7, draft_elements=5 * 10**7,
                  draft_head_elements=5 * 10**6, draft_kv_bytes_per_token=10**4, draft_attention_flops_per_key=10**3,
                  held_bytes=6 * 10**9)


def test_prediction_tables_predict_each_device_at_each_concurrency():
    spec = SpecConfig(3, 1, 4)
    acceptance = (0.8, 0.6, 0.4)
    lines, rows = report.prediction_tables(COSTS, spec, (1, 1, 8), [SMALL, BIG], [1, 8], acceptance, context=512,
                                           hbm_efficiency=0.5, step_overhead_ms=0.25)
    assert len(lines) == 2 * (4 + 2) and len(rows) == 4
    assert lines[0] == "" and lines[1] == (
        "prediction (roofline): mesh 1,1,8, SMALL (1 GB/s x 0.5, 1 bf16 TFLOP/s, step overhead 0.25 ms), chain:3:1:4, "
        "acceptance 0.8,0.6,0.4 (tau 2.80), mean context 512 tokens")
    assert tuple(lines[2:4]) == report.PREDICTION_HEAD and lines[7].startswith("prediction (roofline): mesh 1,1,8, BIG")
    hw = Hardware("BIG", 2.0, 1.0, 0.5, 0.25)
    expected = predict(COSTS, hw, spec, acceptance, 8, 512)
    row = rows[3]
    assert (row["device"], row["concurrency"], row["mesh"], row["context"]) == ("BIG", 8, [1, 1, 8], 512)
    assert row["tau"] == pytest.approx(2.8) and row["spec"] == "chain:3:1:4" and row["acceptance"] == [0.8, 0.6, 0.4]
    assert (row["hbm_efficiency"], row["step_overhead_ms"]) == (0.5, 0.25)
    assert row["spec_step_ms"] == expected.spec_step_ms and row["plain_tpot_ms"] == expected.plain_tpot_ms
    assert row["speedup"] == expected.speedup and row["verify_bound"] == expected.verify_bound
    assert row["fits"] is False  # 6 GB of weights on 1000 bytes
    assert lines[-1] == report.prediction_line(expected, fits=False)


def test_capacity_search_finds_the_largest_batch_that_fits():
    """`max_sequences` on a need that is linear in the batch beyond a bump at small batches (the
    MoE's form changing): the largest multiple of the step that fits, in a few plans."""
    import types

    from eagle3_jax.planning.capacity import MAX_PLANS, max_sequences
    from eagle3_jax.planning.memory import GB, Device

    device = Device("X", 256 * GB, 1.0, 1.0)
    asked = []

    def plan_at(batch, fixed=70 * GB, per=0.55 * GB, bump=6 * GB):
        asked.append(batch)
        total = fixed + per * batch + (bump if batch < 16 else 0)
        return types.SimpleNamespace(batch=batch, total_bytes=int(total), kv_bytes=int(0.5 * GB * batch))

    found = max_sequences(plan_at, device, step=4)
    best = max(b for b in range(4, 2000, 4) if 70 * GB + 0.55 * GB * b + (6 * GB if b < 16 else 0) <= 256 * GB)
    assert found.plans_compiled <= MAX_PLANS and len(asked) == found.plans_compiled
    assert best * 0.97 <= found.sequences <= best and found.sequences % 4 == 0
    assert max_sequences(lambda b: plan_at(b, fixed=300 * GB), device, step=8).sequences == 0
