"""`tcnn study`: a finished study's committed results (results.py) and its README section (render.py).

    tcnn study export SWEEP_DIR OUT_DIR      # results.csv, history.csv, attention.csv, cost.csv, meta.json
    tcnn study render OUT_DIR [--readme README.md] [--check]

Each verb is one function: :func:`pipelines.studies.results.export`, :func:`pipelines.studies.render.render`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipelines.studies.render import render
from pipelines.studies.results import StudyError, export


def add_parser(sub: Any) -> None:
    p = sub.add_parser("study", help="a finished study's committed results and its README section")
    verbs = p.add_subparsers(dest="study_verb", required=True)
    e = verbs.add_parser("export", help="write the small results tables of a finished sweep")
    e.add_argument("sweep_dir", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--cpu", default=None, help="the CPU(s) the trials ran on, where their records do not say")
    e.set_defaults(func=_main_export)
    r = verbs.add_parser("render", help="figures and the README section from the committed tables")
    r.add_argument("results", type=Path)
    r.add_argument("--readme", type=Path, default=None)
    r.add_argument("--check", action="store_true", help="exit 1 when the README block is not up to date")
    r.set_defaults(func=_main_render)


def _main_export(args: argparse.Namespace) -> int:
    try:
        for path in export(args.sweep_dir, args.out, cpu=args.cpu):
            print(f"study: wrote {path}")
    except (StudyError, OSError) as err:
        print(f"tcnn study: error: {err}", file=sys.stderr)
        return 2
    return 0


def _main_render(args: argparse.Namespace) -> int:
    try:
        section, same = render(args.results, args.readme, check=args.check)
    except (StudyError, OSError) as err:
        print(f"tcnn study: error: {err}", file=sys.stderr)
        return 2
    if args.readme is None:
        print(section)
    elif args.check and not same:
        print(
            f"tcnn study: {args.readme} is not up to date with {args.results} (run without --check)",
            file=sys.stderr,
        )
        return 1
    return 0
