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
`--kernels=triton --arch=gfx942` plans the program the GPU runs with the Triton kernels (they
dequantize in registers): each kernel stands in as an op of its exact output shapes.

With --concurrency it also predicts, per mesh and device, plain and speculative decoding at each
concurrency: step time, TPOT, output throughput and speedup from a roofline of what each step reads
and computes (eagle3_jax/planning/roofline.py), for the per-position acceptance of --acceptance and a mean
context of --context tokens (apart from --max_len, the cache a sequence may fill):

    python scripts/plan.py --target=tests/data/kimi-k2.5.config.json --draft=tests/data/kimi-k2.5-eagle3.draft.json \\
        --meshes=1,1,8 --devices=MI325X --nomemory --concurrency=1,2,4,8,16,32,40,64,128,256 \\
        --acceptance=0.99,0.97,0.97 --context=1536

With --capacity it finds, per mesh and device, the most sequences of each of those contexts that
fit (a search over plans of the decode step, speculative with --draft; batches are multiples of the
data axis), e.g. Kimi-K2.5's long-context layouts with an FP8 KV cache:

    python scripts/plan.py --target=tests/data/kimi-k2.5.config.json --draft=tests/data/kimi-k2.5-eagle3.draft.json \
        --meshes="1,1,8;1,8,1;8,1,1" --devices=MI325X --nomemory --capacity=8192,32768,131072 --kv_cache_dtype=fp8

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
from eagle3_jax.cli.flags import define_kv_cache_dtype_flag, int_list, parse_spec_text  # noqa: E402

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
flags.DEFINE_bool("memory", True, "Compile the programs and print the memory table (--nomemory: the prediction or "
                  "capacity only).")
flags.DEFINE_list("capacity", None, "Contexts (tokens per sequence, e.g. 8192,32768,131072): print the most sequences "
                  "of each that fit every --devices, per mesh (compiles a few plans per context).")
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
                    "dot); triton (or per op, e.g. attention=xla,moe=triton): plan the program a GPU runs with the Triton "
                    "kernels, each standing in as an op of its exact output shapes. Needs --arch.")
flags.DEFINE_string("arch", None, "With --kernels=triton: the GPU the kernels run on (gfx942 = MI300X / MI325X, gfx950 = "
                    "MI355X, sm_90 = H100 / H200, sm_100); its launch parameters are used.")
define_kv_cache_dtype_flag()
flags.mark_flag_as_required("target")


def main(argv: list[str]) -> int:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, {"--target": FLAGS.target}, is_file=True)
    import jax

    import eagle3_jax as e3
    from eagle3_jax.planning import report
    from eagle3_jax.planning.memory import DEVICES
    from eagle3_jax.runtime.kernels import parse
    from eagle3_jax.weights.params import flat_specs
    from pallas_kernels.launch import ARCHS

    with cli.usage_errors():
        meshes = report.parse_meshes(FLAGS.meshes)
    unknown = [d for d in FLAGS.devices if d not in DEVICES]
    if unknown:
        raise app.UsageError(f"unknown --devices {unknown}; known: {', '.join(DEVICES)}")
    batches = int_list(FLAGS.batches, "batches")
    spec = parse_spec_text(FLAGS.spec, "spec")
    if spec is None and FLAGS.draft:
        raise app.UsageError("--spec=none plans plain decoding: drop --draft, or pick a setting like chain:3:1:4")
    with cli.usage_errors("--kernels"):
        kernel_choice = parse(FLAGS.kernels)
    if any(impl != "xla" for impl in kernel_choice.values()) and FLAGS.arch not in ARCHS:
        raise app.UsageError(f"--kernels={FLAGS.kernels} plans a GPU program: name the GPU with --arch "
                             f"(one of {', '.join(ARCHS)})")
    devices = [DEVICES[d] for d in FLAGS.devices]
    unit = report.UNITS[FLAGS.unit]
    concurrencies = None if FLAGS.concurrency is None else int_list(FLAGS.concurrency, "concurrency", positive=True)
    acceptance = _acceptance()
    contexts = None if FLAGS.capacity is None else int_list(FLAGS.capacity, "capacity", positive=True)
    if not FLAGS.memory and concurrencies is None and contexts is None:
        raise app.UsageError("--nomemory leaves nothing to print: give --concurrency for the prediction or --capacity")
    if concurrencies is not None and not FLAGS.draft:
        raise app.UsageError("--concurrency predicts speculation's payoff: give the --draft it runs with")
    settings = report.PlanSettings(FLAGS.target, FLAGS.draft, spec if FLAGS.draft else None, FLAGS.max_len,
                                   quant=FLAGS.quant, dtype=FLAGS.dtype, kernels=FLAGS.kernels, arch=FLAGS.arch,
                                   kv_cache_dtype=FLAGS.kv_cache_dtype)
    print(settings.title(FLAGS.tau, FLAGS.unit, FLAGS.memory))
    with cli.usage_errors("--target"):
        specs = flat_specs(e3.load_model_config(FLAGS.target))
    replicated = [n for shape in meshes for n in report.replication_notes(specs, shape, FLAGS.dtype, unit, FLAGS.unit)]
    if replicated:  # known from the shapes alone: said before the compiles
        print("\n".join(replicated), flush=True)
    for shape in meshes:  # every mesh checked before the first compile
        count = shape[0] * shape[1] * shape[2]
        if count > jax.device_count():
            raise app.UsageError(f"mesh {shape} needs {count} devices but {jax.device_count()} exist; set "
                                 f"XLA_FLAGS=--xla_force_host_platform_device_count={count} on a CPU host")
    if FLAGS.memory:
        print("\n".join(report.memory_head(devices)))
    plans, notes, predictions = [], [], []
    for shape in meshes:
        with cli.usage_errors("--meshes"):
            mesh = e3.make_mesh(*shape, devices=jax.devices()[:shape[0] * shape[1] * shape[2]])
        if concurrencies is not None:
            predictions.append((shape, mesh))
        for batch in batches if FLAGS.memory else ():
            # plan_memory's ValueErrors name a configuration it cannot plan (a mesh the model does not
            # divide, an unknown dtype, ...): the flags' doing
            with cli.usage_errors():
                plan = settings.plan(mesh, batch)
            plans.append(plan)
            print(report.memory_row(shape, plan, devices, unit, FLAGS.tau))
            notes += [n for n in (report.over_note(plan, d, unit, FLAGS.unit) for d in devices) if n]
    if notes:
        print()
        print("\n".join(notes))
    capacities = _capacity_table(settings, meshes, devices, contexts) if contexts else []
    predicted = []
    for shape, mesh in predictions:
        with cli.usage_errors():
            setup = settings.setup(mesh)
        lines, rows = report.predict_mesh(setup, shape, devices, concurrencies, acceptance,
                                          FLAGS.context or FLAGS.max_len // 2, FLAGS.hbm_efficiency,
                                          FLAGS.step_overhead_ms)
        print("\n".join(lines))
        predicted += rows
    if FLAGS.json_out:
        out = [p.as_dict() for p in plans] if not (predicted or capacities) else {
            "plans": [p.as_dict() for p in plans], "predictions": predicted, "capacity": capacities}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(out, indent=1))
    return 0


def _capacity_table(settings, meshes, devices, contexts) -> list[dict]:
    """Print the most sequences of each context that fit each device, per mesh; return the rows."""
    import dataclasses

    import jax

    import eagle3_jax as e3
    from eagle3_jax.planning import report
    from eagle3_jax.planning.capacity import max_sequences

    print(f"\ncapacity, KV cache {settings.kv_cache_dtype}: the most sequences that fit each device "
          "(args + temps per device at that batch, GB)")
    print("| mesh d,t,e | context | " + " | ".join(f"{d.name} sequences" for d in devices) + " |")
    print("|---|---|" + "---|" * len(devices))
    rows = []
    for shape in meshes:
        mesh = e3.make_mesh(*shape, devices=jax.devices()[:shape[0] * shape[1] * shape[2]])
        for context in contexts:
            at_context, plans = dataclasses.replace(settings, max_len=context), {}

            def plan_at(batch, at_context=at_context, plans=plans, mesh=mesh):
                if batch not in plans:
                    with cli.usage_errors():
                        plans[batch] = at_context.plan(mesh, batch, programs=("step",))  # the step decides
                return plans[batch]

            cells = []
            for device in devices:
                found = max_sequences(plan_at, device, step=shape[0])
                need = f" ({found.plan.total_bytes / 1e9:.0f})" if found.plan is not None else ""
                cells.append(f"{found.sequences:,}{need}")
                rows.append({"mesh": list(shape), "context": context, "device": device.name,
                             "kv_cache_dtype": settings.kv_cache_dtype, "sequences": found.sequences,
                             "total_bytes": found.plan.total_bytes if found.plan else None})
            print(f"| {report.mesh_text(shape)} | {context:,} | " + " | ".join(cells) + " |", flush=True)
    return rows


def _acceptance() -> tuple[float, ...]:
    from eagle3_jax.sampling.sampler import check_acceptance_profile

    try:
        return check_acceptance_profile([float(x) for x in FLAGS.acceptance])
    except ValueError as e:
        raise app.UsageError(f"--acceptance: {e}".replace("synthetic_acceptance ", "")) from None


if __name__ == "__main__":
    cli.run(main)
