"""How many seeds a T-CNN - control difference needs (issue 36, item 5), from a finished study's committed table.

For a between-seed SD ``s`` of the per-seed difference, Student's 95% interval over ``n`` seeds has half-width
``t_{0.975, n-1} s / sqrt(n)``; the size is the smallest ``n`` that brings it to the target. An SD from three
seeds is itself uncertain: its one-sided 80% upper confidence bound ``s sqrt((n-1) / chi2_{0.2, n-1})``
(scipy.stats.chi2) shows how many seeds a pessimistic reading asks for, which is why the second study
re-estimates the SD from its own pilot before fixing ``n`` (an internal pilot, Wittes & Brittain 1990).

    .venv/bin/python -m pipelines.studies.sizing pipelines/studies/cifar10_lr   # the sizing table in docs/studies.md
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path
from typing import Any

#: The headline differences sized (results.csv columns, fractions) and their names in the table.
METRICS = (("tcnn_minus_control_clean_accuracy", "clean accuracy"), ("tcnn_minus_control_mca", "mCA"))
TARGET = 0.005  # the 95% half-width asked for: 0.5 pp, so that a 1 pp difference is resolved
UPPER = 0.8  # the SD's one-sided upper confidence level


def half_width(sd: float, n: int, confidence: float = 0.95) -> float:
    """Student's ``confidence`` half-width of a mean over ``n`` values with SD ``sd``."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n))


def seeds_needed(sd: float, target: float = TARGET, confidence: float = 0.95, max_n: int = 10_000) -> int:
    """The smallest n >= 2 with :func:`half_width` <= ``target``."""
    for n in range(2, max_n + 1):
        if half_width(sd, n, confidence) <= target:
            return n
    raise ValueError(f"more than {max_n} seeds for SD {sd} and half-width {target}")


def sd_upper(sd: float, n: int, level: float = UPPER) -> float:
    """One-sided ``level`` upper confidence bound of an SD estimated from ``n`` values (chi-square)."""
    from scipy import stats

    return float(sd * math.sqrt((n - 1) / stats.chi2.ppf(1 - level, n - 1)))


def sizing(study_dir: Path) -> list[dict[str, Any]]:
    """Per headline metric: the selected pairs' per-seed differences in ``study_dir/results.csv``, their SD,
    the seeds for a 0.5 pp half-width, and the same at the SD's 80% upper bound."""
    with open(Path(study_dir) / "results.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["row"] == "selected"]
    out = []
    for column, name in METRICS:
        diffs = [float(r[column]) for r in rows if r.get(column) not in (None, "")]
        sd = statistics.stdev(diffs)
        n, hi = seeds_needed(sd), sd_upper(sd, len(diffs))
        out.append({"metric": name, "seeds": len(diffs), "sd": sd, "n": n, "half_width": half_width(sd, n),
                    "sd_upper": hi, "n_upper": seeds_needed(hi)})  # fmt: skip
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The sizing table and its sentence (pp: percentage points)."""
    lines = [
        "| T-CNN - control | seeds measured | SD (pp) | seeds for +-0.5 pp | half-width there (pp) "
        f"| SD's {UPPER:.0%} upper bound (pp) | seeds at that bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['metric']} | {r['seeds']} | {100 * r['sd']:.2f} | {r['n']} | {100 * r['half_width']:.2f} "
                     f"| {100 * r['sd_upper']:.2f} | {r['n_upper']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "results.csv").is_file():
        print(
            "usage: python -m pipelines.studies.sizing STUDY_DIR (a folder holding results.csv)",
            file=sys.stderr,
        )
        return 2
    print(markdown(sizing(Path(args[0]))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
