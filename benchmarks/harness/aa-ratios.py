"""Per cell of an aa-noise-floor.py report: each copy and `auto` against the best original fixed setting.

    python benchmarks/harness/aa-ratios.py benchmarks/results/aa-random-1k1k.json

prints, per concurrency, the ratios per seed and their min over seeds for `auto` and for the copy
of the best original (the setting a perfect `auto` would run), against the best original and
against `none` (recorded: benchmarks/results/aa-random-1k1k-ratios.txt).
"""

import argparse
import json


def main(path: str) -> None:
    with open(path) as f:
        cells = json.load(f)["cells"]
    tput = {(c["setting"], c["concurrency"], c["seed"]): c["metrics"]["output_throughput"] for c in cells}
    names = sorted({c["setting"] for c in cells})
    originals = [n for n in names if not n.startswith("auto") and "#" not in n]
    autos = [n for n in names if n.startswith("auto")]
    worst = {}
    for conc in sorted({c["concurrency"] for c in cells}):
        rows = []
        for seed in sorted({c["seed"] for c in cells}):
            t = {n: tput[(n, conc, seed)] for n in names}
            best = max(originals, key=t.get)
            figures = {"copy of best / best": t[f"{best}#2"] / t[best], "copy of none / none": t["none#2"] / t["none"]}
            for n in autos:
                figures[f"{n} / best"] = t[n] / t[best]
                figures[f"{n} / none"] = t[n] / t["none"]
            for key, value in figures.items():
                worst[(conc, key)] = min(worst.get((conc, key), 9.0), value)
            rows.append(f"seed {seed} best {best}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
        print(f"C={conc}")
        for row in rows:
            print("   ", row)
        print("    min over seeds:", ", ".join(f"{k} {v:.3f}" for (c, k), v in worst.items() if c == conc))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="The JSON report of an aa-noise-floor.py run.")
    main(parser.parse_args().report)
