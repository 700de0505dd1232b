"""``python -m pipelines.sweep ...``: the same command as ``tcnn sweep ...`` (pipelines/sweep/cli.py)."""

from __future__ import annotations

import argparse
import sys

from pipelines.sweep.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    parser.prog = "python -m pipelines.sweep"
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
