"""Plan memory before loading anything: per-device arguments, temps, weights, KV and a roofline step time.

    python scripts/plan.py --target=tests/data/kimi-k2.5.config.json --draft=tests/data/kimi-k2.5-eagle3.draft.json \\
        --meshes=1,1,8 --batches=1,64 --max_len=2304 --devices=MI325X,MI355X

For every mesh (data,tensor,expert) and batch size it AOT-compiles the real programs (speculative
step, plain decode step, prefill chunk) over shape-only sharded arguments and prints XLA's
memory_analysis of the step per device, next to the weight and KV bytes the device holds, the KV
tokens left in each device's HBM, the bytes one step reads (weights it touches + KV), and a roofline TPOT (bytes one step reads / HBM bandwidth / tau).
Before the table it names each mesh axis that does not divide a tensor's dimension (the tensors,
the bytes then replicated on every device, the nearest meshes that divide); under it, for each "NO",
what is over and by how much (weights, KV, other arguments, temps).
Meshes may use fewer devices than exist (the first N devices); on a CPU host, fake as many as you
need with XLA_FLAGS=--xla_force_host_platform_device_count=8.

By default it plans the XLA path, whose MoE dequantizes FP8 / int4 experts to bf16 before the dot.
`--kernels=pallas --arch=gfx942` plans the program the GPU runs with the Pallas kernels (they
dequantize in registers): each kernel stands in as an op of its exact output shapes.

With --concurrency it also predicts, per mesh and device, plain and speculative decoding at each
concurrency: step time, TPOT, output throughput and speedup from a roofline of what each step reads
and computes (eagle3_jax/planning/roofline.py), for the per-position acceptance of --acceptance and a mean
context of --context tokens (apart from --max_len, the cache a sequence may fill):

    python scripts/plan.py --target=tests/data/kimi-k2.5.config.json --draft=tests/data/kimi-k2.5-eagle3.draft.json \\
        --meshes=1,1,8 --devices=MI325X --nomemory --concurrency=1,2,4,8,16,32,40,64,128,256 \\
        --acceptance=0.99,0.97,0.97 --context=1536

The plans are compiled by XLA:CPU. For bfloat16 caches it adds copies a GPU program does not
make: it cannot scatter the new tokens into a bfloat16 cache in place, so temps include about two
copies of the target's KV cache (float32 caches plan with no such temps).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import parse_spec_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target HF / converted folder, or a bare config.json.")
flags.DEFINE_string("draft", None, "EAGLE-3 draft folder or config.json (omit: plain decoding).")
flags.DEFINE_string("meshes", "1,1,8", "Meshes data,tensor,expert separated by ';', e.g. '1,1,8;1,2,4'.")
flags.DEFINE_list("batches", ["1", "64"], "Batch sizes.")
flags.DEFINE_integer("max_len", 2304, "Cache length per sequence (prompt + output + lookahead).")
flags.DEFINE_string("spec", "chain:3:1:4", "Speculation with --draft: chain:num_steps:1:num_draft_tokens or "
                    "tree:num_steps:topk:num_draft_tokens (the older num_steps:topk:num_draft_tokens works too).")
flags.DEFINE_enum("quant", "auto", ["auto", "dequantize", "w4a8"], "auto: weights as the config stores them.")
flags.DEFINE_list("devices", ["MI300X", "MI325X", "MI355X", "H100", "H200"], "Devices to compare against.")
flags.DEFINE_float("tau", 1.0, "Mean acceptance length for the roofline TPOT (1 = plain decoding).")
flags.DEFINE_string("dtype", "bfloat16", "Compute dtype of unquantized weights and caches.")
flags.DEFINE_enum("unit", "GiB", ["GiB", "MiB"], "Unit of the byte columns (MiB for small models).")
flags.DEFINE_string("json_out", None, "Also write every plan as JSON here.")
cli.define_overwrite_flag("--json_out")
flags.DEFINE_bool("memory", True, "Compile the programs and print the memory table (--nomemory: the prediction only).")
flags.DEFINE_list("concurrency", None, "Predict plain and speculative decoding at these concurrencies (e.g. "
                  "1,2,4,8,16,32,64,128,256): step time, TPOT, throughput and speedup per mesh and device.")
flags.DEFINE_list("acceptance", ["0.8", "0.6", "0.4"], "With --concurrency: per-position acceptance rates of the "
                  "draft (rate d: a step accepts at least d draft tokens; a benchmark's per-position acceptance), "
                  "tau = 1 + their sum over the positions --spec drafts.")
flags.DEFINE_integer("context", None, "With --concurrency: mean tokens of context per sequence during decoding (the "
                     "KV each step reads; default --max_len / 2).", lower_bound=1)
flags.DEFINE_float("hbm_efficiency", 1.0, "With --concurrency: the share of peak HBM bandwidth the kernels reach "
                   "(1 = the roofline).", lower_bound=0.01, upper_bound=1.0)
flags.DEFINE_float("step_overhead_ms", 0.0, "With --concurrency: a fixed cost added to every step (launches, "
                   "collectives, host work).", lower_bound=0.0)
flags.DEFINE_string("kernels", "xla", "xla: plan the XLA path (its MoE dequantizes FP8 / int4 experts to bf16 before the "
                    "dot); pallas (or per op, e.g. attention=xla,moe=pallas): plan the program a GPU runs with the Pallas "
                    "kernels, each standing in as an op of its exact output shapes. Needs --arch.")
flags.DEFINE_string("arch", None, "With --kernels=pallas: the GPU the kernels run on (gfx942 = MI300X / MI325X, gfx950 = "
                    "MI355X, sm_90 = H100 / H200, sm_100); its launch parameters are used.")
flags.mark_flag_as_required("target")


def _meshes(raw: str) -> list[tuple[int, int, int]]:
    out = []
    for item in raw.split(";"):
        parts = [p for p in item.replace("x", ",").split(",") if p]
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise app.UsageError(f"--meshes entry {item!r} is not data,tensor,expert (three positive integers)")
        out.append(tuple(int(p) for p in parts))
    return out


# ---- explanations: why a mesh replicates, why a device says NO --------------------------------------------

AXES = ("data", "tensor", "expert")


def undivided(specs: dict, mesh_shape: tuple[int, int, int], dtype: str) -> dict[tuple[str, str, int], list]:
    """{(mesh axis, logical axis, dimension): [(tensor, bytes replicated per device), ...]} for every
    tensor dimension a mesh axis would split but does not divide (sharding.partition_spec then
    replicates it along that axis, as it does here)."""
    from eagle3_jax.runtime.sharding import RULES

    sizes = dict(zip(AXES, mesh_shape))
    out: dict[tuple[str, str, int], list] = {}
    for name, spec in specs.items():
        used: set[str] = set()
        for logical, dim in zip(spec.axes, spec.shape):
            mesh_axis = RULES.get(logical) if logical else None
            if mesh_axis is None or mesh_axis in used or sizes[mesh_axis] == 1:
                continue
            if dim % sizes[mesh_axis]:
                nbytes = spec.nbytes(dtype)
                out.setdefault((mesh_axis, logical, dim), []).append((name, nbytes - nbytes // sizes[mesh_axis]))
            else:
                used.add(mesh_axis)
    return out


def dividing_sizes(size: int, dims: list[int]) -> list[int]:
    """The axis sizes nearest `size` (one below, one above) that divide every one of `dims`."""
    fits = lambda s: all(d % s == 0 for d in dims)  # noqa: E731
    below = next((s for s in range(size - 1, 1, -1) if fits(s)), None)
    above = next((s for s in range(size + 1, 4 * size + 1) if fits(s)), None)
    return [s for s in (below, above) if s is not None]


def replication_notes(specs: dict, mesh_shape: tuple[int, int, int], dtype: str, unit: int, unit_name: str) -> list[str]:
    """One line per mesh axis that leaves tensors whole on every device: which tensors, how many bytes,
    and the nearest meshes whose axis divides them."""
    by_axis: dict[str, list] = {}
    for (mesh_axis, logical, dim), tensors in undivided(specs, mesh_shape, dtype).items():
        by_axis.setdefault(mesh_axis, []).append((logical, dim, tensors))
    notes = []
    mesh_text = ",".join(map(str, mesh_shape))
    for mesh_axis, groups in by_axis.items():
        i = AXES.index(mesh_axis)
        size = mesh_shape[i]
        what = ", ".join(f"{logical}={dim} ({len(t)} tensors, e.g. {t[0][0]})" for logical, dim, t in groups)
        replicated = sum(b for _, _, t in groups for _, b in t)
        options = [",".join(map(str, mesh_shape[:i] + (s,) + mesh_shape[i + 1:]))
                   for s in dividing_sizes(size, [dim for _, dim, _ in groups])]
        notes.append(f"mesh {mesh_text}: the {mesh_axis} axis ({size}) does not divide {what}; they are replicated on "
                     f"every device instead of split {size} ways, {replicated / unit:.1f} {unit_name} more per device"
                     + (f". Meshes that divide: {'; '.join(options)}" if options else ""))
    return notes


def over_note(plan, device, unit: int, unit_name: str) -> str | None:
    """Why `plan` does not fit `device`: what is over by how much, and what makes up the need."""
    if plan.fits(device):
        return None
    other = plan.argument_bytes - plan.weight_bytes - plan.kv_bytes
    mesh_text = ",".join(str(v) for v in plan.mesh_shape.values())
    parts = [f"weights {plan.weight_bytes / unit:.1f}", f"KV {plan.kv_bytes / unit:.2f}"]
    if other > 0:
        parts.append(f"other arguments {other / unit:.2f}")
    parts.append(f"temps {plan.temp_bytes / unit:.1f}")
    return (f"mesh {mesh_text}, batch {plan.batch}, {device.name}: NO, needs {plan.total_bytes / unit:.1f} {unit_name} "
            f"of {device.hbm_bytes / unit:.1f}, {(plan.total_bytes - device.hbm_bytes) / unit:.1f} over ("
            + ", ".join(parts) + ")")


def main(argv: list[str]) -> int:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, {"--target": FLAGS.target}, is_file=True)
    import jax

    import eagle3_jax as e3
    from eagle3_jax.planning.memory import DEVICES, plan_memory
    from eagle3_jax.weights.params import flat_specs

    meshes = _meshes(FLAGS.meshes)
    unknown = [d for d in FLAGS.devices if d not in DEVICES]
    if unknown:
        raise app.UsageError(f"unknown --devices {unknown}; known: {', '.join(DEVICES)}")
    try:
        batches = [int(b) for b in FLAGS.batches]
    except ValueError:
        raise app.UsageError(f"--batches must be comma-separated integers; got {','.join(FLAGS.batches)!r}") from None
    spec = parse_spec_text(FLAGS.spec, "spec")
    if spec is None and FLAGS.draft:
        raise app.UsageError("--spec=none plans plain decoding: drop --draft, or pick a setting like chain:3:1:4")
    from eagle3_jax.runtime.kernels import parse
    from pallas_kernels.launch import ARCHS

    with cli.usage_errors("--kernels"):
        kernel_choice = parse(FLAGS.kernels)
    if any(impl != "xla" for impl in kernel_choice.values()) and FLAGS.arch not in ARCHS:
        raise app.UsageError(f"--kernels={FLAGS.kernels} plans a GPU program: name the GPU with --arch "
                             f"(one of {', '.join(ARCHS)})")
    devices = [DEVICES[d] for d in FLAGS.devices]
    G = {"GiB": 2**30, "MiB": 2**20}[FLAGS.unit]
    concurrencies = _concurrencies()
    acceptance = _acceptance()
    if not FLAGS.memory and concurrencies is None:
        raise app.UsageError("--nomemory leaves nothing to print: give --concurrency for the prediction")
    if concurrencies is not None and not FLAGS.draft:
        raise app.UsageError("--concurrency predicts speculation's payoff: give the --draft it runs with")
    plans = []
    print(f"target {FLAGS.target}" + (f", draft {FLAGS.draft}, spec {spec}" if FLAGS.draft else "")
          + f", max_len {FLAGS.max_len}, quant {FLAGS.quant}"
          + (f", tau {FLAGS.tau} ({FLAGS.unit} per device)" if FLAGS.memory else "")
          + ("" if not FLAGS.memory else
             f"; program: Pallas kernels ({FLAGS.kernels}) on {FLAGS.arch}, each as an op of its output shapes"
             if FLAGS.kernels != "xla" else "; program: the XLA path"))
    head = "| mesh d,t,e | batch | arguments | temps | args+temps | weights | KV | read/step | " + " | ".join(
        f"{d.name} fits / KV tok left / TPOT ms" for d in devices) + " |"
    with cli.usage_errors("--target"):
        specs = flat_specs(e3.load_model_config(FLAGS.target))
    replicated = [n for shape in meshes for n in replication_notes(specs, shape, FLAGS.dtype, G, FLAGS.unit)]
    if replicated:  # known from the shapes alone: said before the compiles
        print("\n".join(replicated), flush=True)
    for shape in meshes:  # every mesh checked before the first compile
        count = shape[0] * shape[1] * shape[2]
        if count > jax.device_count():
            raise app.UsageError(f"mesh {shape} needs {count} devices but {jax.device_count()} exist; set "
                                 f"XLA_FLAGS=--xla_force_host_platform_device_count={count} on a CPU host")
    if FLAGS.memory:
        print(head)
        print("|" + "---|" * (8 + len(devices)))
    notes, predictions = [], []
    for shape in meshes:
        count = shape[0] * shape[1] * shape[2]
        with cli.usage_errors("--meshes"):
            mesh = e3.make_mesh(*shape, devices=jax.devices()[:count])
        if concurrencies is not None:
            predictions.append((shape, mesh))
        for batch in batches if FLAGS.memory else ():
            # plan_memory's ValueErrors name a configuration it cannot plan (a mesh the model does not
            # divide, an unknown dtype, ...): the flags' doing
            with cli.usage_errors():
                p = plan_memory(FLAGS.target, FLAGS.draft, mesh=mesh, batch=batch, max_len=FLAGS.max_len,
                                spec=spec if FLAGS.draft else None,
                                quant=None if FLAGS.quant == "auto" else FLAGS.quant, dtype=FLAGS.dtype,
                                kernels=FLAGS.kernels, arch=FLAGS.arch)
            plans.append(p)
            cells = [f"{'yes' if p.fits(d) else 'NO'} / {p.kv_tokens_left(d):,} / {p.tpot_ms(d, FLAGS.tau):.2f}"
                     for d in devices]
            print(f"| {','.join(map(str, shape))} | {batch} | {p.argument_bytes / G:.1f} | {p.temp_bytes / G:.1f} | "
                  f"{p.total_bytes / G:.1f} | {p.weight_bytes / G:.1f} | {p.kv_bytes / G:.2f} | {p.step_read_bytes / G:.2f} | " + " | ".join(cells) + " |")
            notes += [n for n in (over_note(p, d, G, FLAGS.unit) for d in devices) if n]
    if notes:
        print()
        print("\n".join(notes))
    predicted = [row for shape, mesh in predictions
                 for row in print_prediction(shape, mesh, spec, devices, concurrencies, acceptance)]
    if FLAGS.json_out:
        out = [p.as_dict() for p in plans] if not predicted else {"plans": [p.as_dict() for p in plans],
                                                                  "predictions": predicted}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(out, indent=1))
    return 0


def _concurrencies() -> list[int] | None:
    if FLAGS.concurrency is None:
        return None
    try:
        out = [int(c) for c in FLAGS.concurrency]
    except ValueError:
        out = []
    if not out or any(c < 1 for c in out):
        raise app.UsageError(f"--concurrency must be comma-separated integers >= 1; got {','.join(FLAGS.concurrency)!r}")
    return out


def _acceptance() -> tuple[float, ...]:
    from eagle3_jax.sampling.sampler import check_acceptance_profile

    try:
        return check_acceptance_profile([float(x) for x in FLAGS.acceptance])
    except ValueError as e:
        raise app.UsageError(f"--acceptance: {e}".replace("synthetic_acceptance ", "")) from None


def _ms(x: float) -> str:
    """Milliseconds: two decimals, or three significant digits below 1 ms (small models' steps)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def print_prediction(shape, mesh, spec, devices, concurrencies, acceptance) -> list[dict]:
    """The per-concurrency prediction of one mesh on each device, printed; its rows as dicts."""
    from eagle3_jax.planning.memory import abstract_setup
    from eagle3_jax.planning.roofline import Hardware, mean_accept_length, predict, step_costs

    context = FLAGS.context or FLAGS.max_len // 2
    with cli.usage_errors():
        setup = abstract_setup(FLAGS.target, FLAGS.draft, mesh=mesh, batch=mesh.shape["data"], max_len=16,
                               spec=spec, quant=None if FLAGS.quant == "auto" else FLAGS.quant, dtype=FLAGS.dtype)
    costs = step_costs(setup)
    tau = mean_accept_length(acceptance, setup.spec)
    rows = []
    for d in devices:
        hw = Hardware(d.name, d.hbm_gbps, d.bf16_tflops, FLAGS.hbm_efficiency, FLAGS.step_overhead_ms)
        print(f"\nprediction (roofline): mesh {','.join(map(str, shape))}, {d.name} ({d.hbm_gbps:g} GB/s x "
              f"{FLAGS.hbm_efficiency:g}, {d.bf16_tflops:g} bf16 TFLOP/s, step overhead {FLAGS.step_overhead_ms:g} ms), "
              f"{setup.spec}, acceptance {','.join(f'{a:g}' for a in acceptance)} (tau {tau:.2f}), mean context "
              f"{context} tokens")
        print("| concurrency | plain step = TPOT ms | plain tok/s | spec step ms (verify + draft) | spec TPOT ms | "
              "spec tok/s | speedup | verify bound by | weights + KV fit |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in concurrencies:
            p = predict(costs, hw, setup.spec, acceptance, c, context)
            fits = costs.fits(d.hbm_bytes, c, context)
            print(f"| {c} | {_ms(p.plain_tpot_ms)} | {p.plain_throughput:,.0f} | {_ms(p.spec_step_ms)} ({_ms(p.verify_ms)} + "
                  f"{_ms(p.draft_ms)}) | {_ms(p.spec_tpot_ms)} | {p.spec_throughput:,.0f} | {p.speedup:.2f}x | "
                  f"{p.verify_bound} | {'yes' if fits else 'NO'} |")
            rows.append({"mesh": list(shape), "device": d.name, "concurrency": c, "context": context,
                         "acceptance": list(acceptance), "tau": tau, "spec": str(setup.spec),
                         "hbm_efficiency": FLAGS.hbm_efficiency, "step_overhead_ms": FLAGS.step_overhead_ms,
                         "plain_tpot_ms": p.plain_tpot_ms, "plain_tok_s": p.plain_throughput,
                         "spec_step_ms": p.spec_step_ms, "verify_ms": p.verify_ms, "draft_ms": p.draft_ms,
                         "spec_tpot_ms": p.spec_tpot_ms, "spec_tok_s": p.spec_throughput, "speedup": p.speedup,
                         "verify_bound": p.verify_bound, "fits": fits})
    return rows


if __name__ == "__main__":
    cli.run(main)
