"""Shared command-line plumbing for the stage modules: parse --params, validate, one-line errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from core.config import ConfigError, Params, load_params
from core.importers import DataError


class StageError(RuntimeError):
    """A stage cannot run on its inputs (missing or corrupt checkpoint, bad data): one line, exit 2."""


def stage_main(name: str, run: Callable[[Params], object], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param"
    )
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.set)
        run(params)
    except (ConfigError, StageError, DataError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    return 0
