"""`tcnn study`: a finished study's committed results (results.py) and its README section (render.py).

    tcnn study export SWEEP_DIR OUT_DIR      # results.csv, history.csv, attention.csv, cost.csv, meta.json
    tcnn study render OUT_DIR [--readme README.md] [--check]
    tcnn study run PARAMS --name NAME --out DIR [--readme README.md] [--max-seeds N] [--force] [--dry-run] [-S k=v]
    tcnn study snapshot --sweeps SWEEPS_DIR --name NAME --out DIR [--readme README.md] [--docs docs/studies.md]

Each verb is one function: :func:`pipelines.studies.results.export`, :func:`pipelines.studies.render.render`,
:func:`pipelines.studies.run.run` (search, sequential main seeds, export; resumable),
:func:`pipelines.studies.snapshot.snapshot` (read-only, beside a running study).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from core.utils.output_paths import OutputPathError
from pipelines.studies.render import render
from pipelines.studies.results import export
from pipelines.studies.study_tables import StudyError


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
    g = verbs.add_parser(
        "run", help="search each arm's lr, seeds until the interval is narrow, the answer's block (resumable)"
    )
    g.add_argument("params", type=Path)
    g.add_argument("--name", required=True, help="the study's sweeps are NAME-search and NAME-seed<k>")
    g.add_argument("--out", type=Path, required=True, help="where study.json, the CSVs and study.md go")
    g.add_argument("--readme", type=Path, default=None, help="also write the block into this file")
    g.add_argument(
        "--max-seeds", type=int, default=None, help="at most this many main seeds (default 10; recorded)"
    )
    g.add_argument(
        "--force", action="store_true", help="go on when an arm chose among fewer than min_finished"
    )
    g.add_argument(
        "--records", type=Path, default=None,
        help="trials recorded on another machine (tcnn study snapshot), replayed not trained (default OUT/trials)",
    )  # fmt: skip
    g.add_argument("--dry-run", action="store_true", help="the same steps at smoke size on the CPU")
    g.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param")
    g.set_defaults(func=_main_run)
    s = verbs.add_parser("snapshot", help="a running study's trials so far (progress.csv, progress.json)")
    s.add_argument("--sweeps", type=Path, required=True, help="the sweeps folder the study runs in")
    s.add_argument(
        "--name", required=True, help="the study's name (its sweeps are NAME-search, NAME-seed<k>)"
    )
    s.add_argument("--out", type=Path, required=True, help="where progress.csv and progress.json go")
    s.add_argument("--readme", type=Path, default=None,
                   help="also write the progress lines into its <!-- study:NAME-progress:begin/end --> block")  # fmt: skip
    s.add_argument("--docs", type=Path, default=None,
                   help="also write the progress lines and the search's trials into its NAME-progress block")  # fmt: skip
    s.set_defaults(func=_main_snapshot)


def _main_export(args: argparse.Namespace) -> int:
    try:
        for path in export(args.sweep_dir, args.out, cpu=args.cpu):
            print(f"study: wrote {path}")
    except (StudyError, OutputPathError, OSError) as err:
        print(f"tcnn study: error: {err}", file=sys.stderr)
        return 2
    return 0


def _main_snapshot(args: argparse.Namespace) -> int:
    from core.utils.output_paths import check_output_file
    from pipelines.studies.snapshot import snapshot

    try:
        for path, flag in ((args.readme, "--readme"), (args.docs, "--docs")):
            if path is not None:
                check_output_file(path, flag)
        summary = snapshot(args.sweeps, args.name, args.out)
    except (StudyError, OutputPathError, OSError, ValueError) as err:
        print(f"tcnn study: error: {err}", file=sys.stderr)
        return 2
    for phase, p in summary["phases"].items():
        print(f"study: {phase}: {p['trials_finished']} trial(s) finished of {p['trials_reported']} reported, "
              f"{p['compute_h']:.2f} h recorded")  # fmt: skip
    from pipelines.studies.snapshot import progress_block
    from pipelines.studies.study_block import insert_block

    for path, table in ((args.readme, False), (args.docs, True)):
        if path is not None:
            written = insert_block(path, f"{args.name}-progress", progress_block(args.out, table=table))
            print(f"study: wrote the progress block into {written}")
    print(f"study: wrote {args.out / 'progress.csv'} and {args.out / 'progress.json'}; "
          f"{len(summary['records_written'])} trial record(s) new or changed, {summary['trials_recorded']} in "
          f"{args.out / 'trials'}")  # fmt: skip
    return 0


def _main_render(args: argparse.Namespace) -> int:
    from pipelines.studies.run import STATE, StudyRunError
    from pipelines.studies.study_block import render_block

    try:
        if (args.results / STATE).is_file():  # a `tcnn study run` output: its block from study.json
            section, same = render_block(args.results, args.readme, check=args.check)
        else:
            section, same = render(args.results, args.readme, check=args.check)
    except (StudyError, StudyRunError, OutputPathError, OSError, ValueError) as err:
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


def _main_run(args: argparse.Namespace) -> int:
    """`tcnn study run`: its sweeps driven from this process (pipelines.sweep.cli.driving_sweeps: a stop signal
    exits 75, 130 for Ctrl-C); running it again continues."""
    import os

    from pipelines.studies.run import run
    from pipelines.studies.sequential import FIRST
    from pipelines.sweep.cli import command_status, driving_sweeps

    if args.max_seeds is not None and args.max_seeds < FIRST:
        print(f"tcnn study: error: --max-seeds {args.max_seeds}: at least {FIRST} (the seeds run before the "
              "rule is first applied)", file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        os.environ["TCNN_DEVICE"] = "cpu"

    def body() -> int:
        with driving_sweeps():
            rec = run(args.params, args.name, args.out, overrides=args.set, max_seeds=args.max_seeds,
                      dry_run=args.dry_run, readme=args.readme, force=args.force,
                      records=args.records)  # fmt: skip
        print(f"study: wrote {args.out / 'study.json'} and {args.out / 'study.md'}")
        for m in ("clean_accuracy", "mca", "mce"):
            r = rec["answer"][m]
            print(f"study: {r['name']}: T-CNN - control {100 * r['mean']:+.2f} pp "
                  f"[{100 * r['low']:+.2f}, {100 * r['high']:+.2f}]")  # fmt: skip
        return 0

    return command_status(
        "tcnn study", body, again="run it again to continue", errors=(StudyError, OutputPathError)
    )
