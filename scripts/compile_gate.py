"""Compile every Triton kernel the engine launches to AMD and NVIDIA machine code, without a GPU.

    python scripts/compile_gate.py                               # the representative subset (about a minute)
    python scripts/compile_gate.py --scope=full --json_out=benchmarks/results/compile-gate.json \\
        --markdown_out=benchmarks/results/compile-gate.md          # every configuration, mesh, format, T, batch

For each bundled full-size configuration on its documented meshes (eagle3_jax/planning/compile_gate.py
lists them) the engine's own programs are traced for each architecture (gfx942 = MI300X / MI325X,
gfx950 = MI355X, sm_90 = H100 / H200; sm_100 on request), every kernel launch in them is compiled
from the kernel's source with the `triton` package, and one line per distinct launch reports
registers, AGPRs, spills, shared memory (LDS), occupancy and the matrix instructions used. It exits 1 if any kernel fails
to compile, spills (AGPRs in use count as spills on AMD) or needs more shared memory than the
architecture has. The devices are faked on a CPU host (8 of them, set here before JAX starts).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("scope", "representative", ["representative", "full"],
                  "representative: each configuration's largest launched shape; full: every configuration x mesh x "
                  "format x batch (1, 64) x tokens (1, 4, 16, 64) and a prefill chunk.")
flags.DEFINE_list("archs", ["gfx942", "gfx950", "sm_90"], "Architectures to compile for (gfx942, gfx950, sm_90, sm_100).")
flags.DEFINE_list("configs", [], "Only these configurations (names as printed; default: all).")
flags.DEFINE_string("json_out", None, "Also write every row as JSON here.")
flags.DEFINE_string("markdown_out", None, "Also write the tables as Markdown here.")
cli.define_overwrite_flag("--json_out / --markdown_out")


def _table(rows) -> list[str]:
    lines = ["| arch | kernel | constexprs | warps/stages | regs | AGPR | spills (scratch / VGPR / ptxas) | shared B | "
             "occupancy | matrix instructions | launches | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.arch, r.kernel, r.shape)):
        rep = r.report
        spills = (f"{rep.scratch_bytes or 0} / {rep.vgpr_spills or 0} / "
                  f"{(rep.spill_store_bytes or 0) + (rep.spill_load_bytes or 0)}")
        lines.append(f"| {r.arch} | {r.kernel} | {r.shape} | {rep.num_warps}/{rep.num_stages} | "
                     f"{rep.registers} | {rep.agprs if rep.agprs is not None else '-'} | {spills} | {rep.shared_bytes} | "
                     f"{rep.occupancy} | {', '.join(rep.matrix_instructions) or '-'} | {len(r.launches)} | "
                     f"{'ok' if not r.problems else '; '.join(r.problems)} |")
    return lines


def _summary(rows) -> list[str]:
    """Per kernel and architecture: the worst occupancy, the most registers and shared memory."""
    worst = collections.defaultdict(list)
    for r in rows:
        worst[(r.kernel, r.arch)].append(r)
    lines = ["| kernel | arch | distinct launches | worst occupancy | max regs | max shared B | all pass |",
             "|---|---|---|---|---|---|---|"]
    for (name, arch), group in sorted(worst.items()):
        occ = [g.report.occupancy for g in group if g.report.occupancy is not None]
        regs = [g.report.registers for g in group if g.report.registers is not None]
        shared = [g.report.shared_bytes for g in group if g.report.shared_bytes is not None]
        lines.append(f"| {name} | {arch} | {len(group)} | {min(occ) if occ else '-'} | {max(regs) if regs else '-'} | "
                     f"{max(shared) if shared else '-'} | {'yes' if all(not g.problems for g in group) else 'NO'} |")
    return lines


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    cli.check_output("--markdown_out", FLAGS.markdown_out, {"--json_out": FLAGS.json_out}, is_file=True)
    from pallas_kernels import isa, launch

    if isa.triton_version() is None:
        raise app.UsageError("the `triton` package is not installed; install the test extra (pip install -e '.[test]')")
    unknown = [a for a in FLAGS.archs if a not in launch.ARCHS]
    if unknown:
        raise app.UsageError(f"--archs: unknown {', '.join(unknown)}; known: {', '.join(launch.ARCHS)}")
    import jax

    from eagle3_jax.planning import compile_gate as gate

    configs = gate.CONFIGS
    if FLAGS.configs:
        names = {c.name for c in configs}
        missing = [c for c in FLAGS.configs if c not in names]
        if missing:
            raise app.UsageError(f"--configs: unknown {', '.join(missing)}; known: {', '.join(sorted(names))}")
        configs = tuple(c for c in configs if c.name in FLAGS.configs)
    cases = gate.cases(configs) if FLAGS.scope == "full" else gate.representative_cases(configs)
    items = list(cases) + list(gate.EXTRA)
    print(f"compile gate: {len(items)} programs x {len(FLAGS.archs)} architectures ({FLAGS.scope}), "
          f"jax {jax.__version__}, triton {isa.triton_version()}", flush=True)
    t0 = time.perf_counter()
    rows = gate.run_gate(items, FLAGS.archs, progress=lambda line: print("  " + line, flush=True))
    seconds = time.perf_counter() - t0
    failed = [r for r in rows if r.problems]
    tables = ["## Per kernel and architecture", "", *_summary(rows), "", "## Every distinct kernel", "", *_table(rows)]
    print("\n".join(tables))
    print(f"\n{len(rows)} distinct kernels compiled in {seconds:.0f} s; {len(failed)} fail")
    header = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPU cores",
              "jax": jax.__version__, "triton": isa.triton_version(), "scope": FLAGS.scope, "archs": FLAGS.archs,
              "command": "python scripts/compile_gate.py " + " ".join(sys.argv[1:]), "seconds": round(seconds, 1)}
    if FLAGS.json_out:
        cli.write_output("--json_out", FLAGS.json_out, json.dumps({**header, "rows": [r.as_dict() for r in rows]},
                                                                   indent=1))
    if FLAGS.markdown_out:
        cli.write_output("--markdown_out", FLAGS.markdown_out, "# Compile gate\n\n" + "\n".join(
            f"- {k}: {v}" for k, v in header.items()) + "\n\n" + "\n".join(tables) + "\n")
    if failed:
        for r in failed:
            print(f"FAIL {r.arch} {r.kernel} {r.shape}: {'; '.join(r.problems)} (e.g. {r.launches[0]})",
                  file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
