"""How far this host lets one measure `auto` against the best fixed setting.

    python benchmarks/harness/aa-noise-floor.py BENCH_FLAGS...

runs `scripts/bench.py` with its flags and, beside the settings `--spec` names, a second copy of
each fixed setting (`none#2`, `chain:3:1:4#2`): the same program in its own scheduler, measured in
the same interleaved passes as the others. A copy of the best fixed setting is what a perfect
`auto` would run, so its ratio to the best of the originals, min over seeds, is the lowest figure
a perfect `auto` could be scored at by the same sweep; `benchmarks/harness/aa-ratios.py
REPORT.json` prints it per cell beside `auto`'s. Every flag is bench.py's (`--help` lists them
after this text), and it runs from the repository root (relative paths are read from there): the
report goes where bench.py's `--out_dir` and `--name` say, by default benchmarks/results/.
"""

import os
import runpy
import sys

from ab_common import ROOT

BENCH = os.path.join(ROOT, "scripts", "bench.py")


def _with_copies(parse_specs):
    def parse(texts):
        """The settings as written, then a copy of each fixed one under the name `<name>#2`."""
        from eagle3_jax.bench import settings as settings_lib

        settings = parse_specs(texts)
        copies = [settings_lib.SpecSetting(f"{s.name}#2", s.spec) for s in settings if not s.name.startswith("auto")]
        return settings + copies
    return parse


def main() -> None:
    if any(a in ("-h", "--help", "--helpfull") for a in sys.argv[1:]):
        print(__doc__)
        print("scripts/bench.py's flags follow.\n", flush=True)
    from eagle3_jax.bench import settings as settings_lib

    settings_lib.parse_specs = _with_copies(settings_lib.parse_specs)
    os.chdir(ROOT)  # bench.py's defaults (checkpoints/, benchmarks/results) are relative to the repository
    sys.argv = [BENCH, *sys.argv[1:]]
    runpy.run_path(BENCH, run_name="__main__")


if __name__ == "__main__":
    main()
