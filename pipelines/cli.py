"""The `tcnn` console script: user verbs around the pipeline."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError
from pipelines.sweep.sweep_params import load_sweep_params


def _validate(args: argparse.Namespace) -> int:
    """The params, and what they name that can be checked without compute: a published benchmark's array
    headers and labels against the prepared data, or before prepare against what the dataset's name says
    (under `dvc repro` the check stage runs the same check before any training, and evaluate again before any
    model loads)."""
    params = load_sweep_params(args.file, args.set)  # the sweep section too
    if params.robustness.public is not None:
        from stages.harness.runner import StageError
        from stages.published_check import check_public_sets

        try:
            check_public_sets(params, prepared=False)
        except StageError as err:
            print(f"tcnn validate: error: {err}", file=sys.stderr)
            return 2
    print(f"{args.file}: ok ({params.data.name}, {params.model.kind}/{params.model.arch})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tcnn", description="Transformed CNNs research pipeline")
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("validate", help="validate a params file")
    p.add_argument("file", nargs="?", default="params.yaml")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=_validate)
    from pipelines.sweep.cli import add_parser as add_sweep  # light: Ray, torch and MLflow load when it runs

    add_sweep(sub)
    from pipelines.studies.cli import add_parser as add_study

    add_study(sub)
    from pipelines.views import add_parser as add_show

    add_show(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"tcnn {args.verb}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
