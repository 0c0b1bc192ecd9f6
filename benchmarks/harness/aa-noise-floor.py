"""How far this host lets one measure `auto` against the best fixed setting (run from the repository root).

`python benchmarks/results/aa-noise-floor.py BENCH_FLAGS...` runs `scripts/bench.py` with its flags
and, beside the settings `--spec` names, a second copy of each fixed setting (`none#2`,
`chain:3:1:4#2`): the same program in its own scheduler, measured in the same interleaved passes
as the others. A copy of the best fixed setting is what a perfect `auto` would run, so its ratio to
the best of the originals, min over seeds, is the lowest figure a perfect `auto` could be scored
at by the same sweep; `benchmarks/results/aa-ratios.py REPORT.json` prints it per cell beside
`auto`'s.
"""

import runpy
import sys

from eagle3_jax.bench import settings as settings_lib

_parse_specs = settings_lib.parse_specs


def _with_copies(texts):
    """The settings as written, then a copy of each fixed one under the name `<name>#2`."""
    settings = _parse_specs(texts)
    copies = [settings_lib.SpecSetting(f"{s.name}#2", s.spec) for s in settings if not s.name.startswith("auto")]
    return settings + copies


settings_lib.parse_specs = _with_copies
sys.path.insert(0, "scripts")  # bench.py imports its sibling _cli
sys.argv = ["scripts/bench.py", *sys.argv[1:]]
runpy.run_path("scripts/bench.py", run_name="__main__")
