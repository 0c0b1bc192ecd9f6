"""Compile every Triton kernel the engine launches to AMD and NVIDIA machine code, without a GPU.

    python scripts/compile_gate.py                               # the representative subset (about a minute)
    python scripts/compile_gate.py --scope=full --json_out=benchmarks/results/compile-gate.json \\
        --markdown_out=benchmarks/results/compile-gate.md          # every configuration, mesh, format, T, batch
    python scripts/compile_gate.py --json_in=gfx942.json,sm_90.json --json_out=... # parts (--archs runs) as one record

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
flags.DEFINE_list("json_in", [], "Compile nothing: merge these --json_out records (e.g. one per --archs run) into "
                  "one, written to --json_out / --markdown_out.")
flags.DEFINE_string("json_out", None, "Also write every row as JSON here.")
flags.DEFINE_string("markdown_out", None, "Also write the tables as Markdown here.")
cli.define_overwrite_flag("--json_out / --markdown_out")


def _shape(row: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in row["constexprs"].items() if k != "INTERPRETED")


def _table(rows: list[dict]) -> list[str]:
    lines = ["| arch | kernel | constexprs | warps/stages | regs | AGPR | spills (scratch / VGPR / ptxas) | shared B | "
             "occupancy | matrix instructions | launches | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["arch"], r["kernel"], _shape(r))):
        spills = (f"{r['scratch_bytes'] or 0} / {r['vgpr_spills'] or 0} / "
                  f"{(r['spill_store_bytes'] or 0) + (r['spill_load_bytes'] or 0)}")
        lines.append(f"| {r['arch']} | {r['kernel']} | {_shape(r)} | {r['num_warps']}/{r['num_stages']} | "
                     f"{r['registers']} | {r['agprs'] if r['agprs'] is not None else '-'} | {spills} | "
                     f"{r['shared_bytes']} | {r['occupancy']} | {', '.join(r['matrix_instructions']) or '-'} | "
                     f"{len(r['launches'])} | {'ok' if not r['problems'] else '; '.join(r['problems'])} |")
    return lines


def _summary(rows: list[dict]) -> list[str]:
    """Per kernel and architecture: the worst occupancy, the most registers and shared memory."""
    worst = collections.defaultdict(list)
    for r in rows:
        worst[(r["kernel"], r["arch"])].append(r)
    lines = ["| kernel | arch | distinct launches | worst occupancy | max regs | max shared B | all pass |",
             "|---|---|---|---|---|---|---|"]
    for (name, arch), group in sorted(worst.items()):
        occ = [g["occupancy"] for g in group if g["occupancy"] is not None]
        regs = [g["registers"] for g in group if g["registers"] is not None]
        shared = [g["shared_bytes"] for g in group if g["shared_bytes"] is not None]
        lines.append(f"| {name} | {arch} | {len(group)} | {min(occ) if occ else '-'} | {max(regs) if regs else '-'} | "
                     f"{max(shared) if shared else '-'} | {'yes' if all(not g['problems'] for g in group) else 'NO'} |")
    return lines


def _merged(paths: list[str]) -> tuple[dict, list[dict]]:
    """The header and rows of --json_in parts (one per architecture, say) as one record: each
    part's command, date and seconds kept, in order."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    header = {k: v for k, v in parts[0].items() if k != "rows"}
    for key in ("date", "machine", "jax", "triton", "scope", "command", "seconds"):
        values = [p[key] for p in parts]
        same = len(parts) == 1 or key not in ("command", "seconds") and all(v == values[0] for v in values)
        header[key] = values[0] if same else values
    header["archs"] = [a for p in parts for a in p["archs"]]
    header["merged"] = "python scripts/compile_gate.py " + " ".join(sys.argv[1:])
    return header, [r for p in parts for r in p["rows"]]


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
    missing = [p for p in FLAGS.json_in if not os.path.isfile(p)]
    if missing:
        raise app.UsageError(f"--json_in: no such file {', '.join(missing)}")
    if FLAGS.json_in:
        header, rows = _merged(FLAGS.json_in)
    else:
        header, rows = _compile()
    failed = [r for r in rows if r["problems"]]
    tables = ["## Per kernel and architecture", "", *_summary(rows), "", "## Every distinct kernel", "", *_table(rows)]
    print("\n".join(tables))
    print(f"\n{len(rows)} distinct kernels; {len(failed)} fail")
    if FLAGS.json_out:
        cli.write_output("--json_out", FLAGS.json_out, json.dumps({**header, "rows": rows}, indent=1))
    if FLAGS.markdown_out:
        cli.write_output("--markdown_out", FLAGS.markdown_out, "# Compile gate\n\n" + "\n".join(
            f"- {k}: {v}" for k, v in header.items()) + "\n\n" + "\n".join(tables) + "\n")
    if failed:
        for r in failed:
            print(f"FAIL {r['arch']} {r['kernel']} {_shape(r)}: {'; '.join(r['problems'])} (e.g. {r['launches'][0]})",
                  file=sys.stderr)
        sys.exit(1)


def _compile() -> tuple[dict, list[dict]]:
    """Trace and compile the scope's programs: the record's header and its rows."""
    import jax

    from eagle3_jax.planning import compile_gate as gate
    from pallas_kernels import isa

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
    print(f"{len(rows)} distinct kernels compiled in {seconds:.0f} s")
    header = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPU cores",
              "jax": jax.__version__, "triton": isa.triton_version(), "scope": FLAGS.scope, "archs": FLAGS.archs,
              "command": "python scripts/compile_gate.py " + " ".join(sys.argv[1:]), "seconds": round(seconds, 1)}
    return header, [r.as_dict() for r in rows]

if __name__ == "__main__":
    cli.run(main)
