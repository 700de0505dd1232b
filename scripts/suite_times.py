"""Where the test suite's time goes: per-test and per-file wall times from pytest's JUnit XML.

    .venv/bin/python -m pytest --junitxml=times.xml ...
    .venv/bin/python scripts/suite_times.py times.xml [--before old.xml] [--top 40] [--files 30]

Prints Markdown: each test file's summed time (setup + call + teardown of its tests, as JUnit records them)
and the slowest tests, side by side with ``--before`` when given. Under pytest-xdist the times are each test's
own; the run's wall time is the pytest summary line's, not their sum.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read(path: Path) -> dict[str, float]:
    """{test file::name: seconds} of a JUnit XML report."""
    out: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        out[f"{module}.py::{case.get('name')}"] = float(case.get("time") or 0)
    return out


def by_file(times: dict[str, float]) -> Counter[str]:
    files: Counter[str] = Counter()
    for test, s in times.items():
        files[test.split("::")[0].removeprefix("tests/")] += s
    return files


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def table(after: dict[str, float], before: dict[str, float] | None, top: int, files_top: int) -> str:
    lines = []
    fa, fb = by_file(after), by_file(before or {})
    head = "| file | before (s) | after (s) |" if before else "| file | seconds |"
    lines += [
        "### Per file (sum of the tests' own times)",
        "",
        head,
        "|---|---:|---:|" if before else "|---|---:|",
    ]
    order = sorted(set(fa) | set(fb), key=lambda f: -max(fa.get(f, 0), fb.get(f, 0)))[:files_top]
    for f in order:
        lines.append(
            f"| {f} | {_cell(fb.get(f))} | {_cell(fa.get(f))} |" if before else f"| {f} | {fa[f]:.1f} |"
        )
    total_a, total_b = sum(after.values()), sum((before or {}).values())
    lines.append(f"| **all {len(after)} tests** | {total_b:.0f} | {total_a:.0f} |" if before
                 else f"| **all {len(after)} tests** | {total_a:.0f} |")  # fmt: skip
    lines += ["", f"### The {top} slowest tests", "", head.replace("file", "test"),
              "|---|---:|---:|" if before else "|---|---:|"]  # fmt: skip
    slow = sorted(
        set(after) | set(before or {}), key=lambda t: -max(after.get(t, 0), (before or {}).get(t, 0))
    )
    for t in slow[:top]:
        name = t.removeprefix("tests/")
        lines.append(f"| {name} | {_cell((before or {}).get(t))} | {_cell(after.get(t))} |" if before
                     else f"| {name} | {after[t]:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("after", type=Path, help="JUnit XML of the run to describe")
    ap.add_argument("--before", type=Path, help="JUnit XML of an earlier run, shown beside it")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--files", type=int, default=30)
    args = ap.parse_args(argv)
    before = read(args.before) if args.before else None
    print(table(read(args.after), before, args.top, args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
