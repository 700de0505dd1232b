"""`tcnn show metrics|plots [DVC's options]`: DVC's two views of a run, after checking the files they need.

DVC's own commands cannot be told what the project's files are for, and say little when one is missing (DVC
3.x): `dvc metrics show` with the headline folder deleted prints a vague line and exits 0; `dvc plots show`
with the offline page template missing says "HTML template has to contain '{plot_divs}'" (it takes the
missing path for the template's text). This verb names the missing file and the command that brings it back
(one line, exit 2), then runs DVC's command with the given options (``tcnn show plots --open``).
"""

from __future__ import annotations

import argparse
import configparser
import os
import shutil
import sys
from pathlib import Path

#: The headline folder: dvc.yaml's one ``metrics:`` entry (stages.harness.chain.headline_dir).
HEADLINE = "results/headline"
#: The offline page scripts/dvc_plots_page.py writes, where .dvc/config's ``plots.html_template`` points.
PAGE_COMMAND = ".venv/bin/python scripts/dvc_plots_page.py"


def headline_problem(root: Path) -> str | None:
    """Why `dvc metrics show` has no headline to print (and the commands that bring it back), or None."""
    folder = root / HEADLINE
    if folder.is_dir() and any(folder.glob("*.json")):
        return None
    state = "is empty" if folder.is_dir() else "is missing"
    return (
        f"{HEADLINE}/ (the headline, DVC's only metrics) {state}: `git checkout -- {HEADLINE}` brings back the "
        f"committed one, `.venv/bin/dvc repro evaluate` this workspace's (from DVC's run cache when it holds "
        f"the run, else by evaluating)"
    )


def template_of(root: Path) -> Path | None:
    """The page template .dvc/config names (``plots.html_template``, relative to .dvc/ as DVC reads it)."""
    config = configparser.ConfigParser()
    config.read(root / ".dvc" / "config")
    value = config.get("plots", "html_template", fallback=None)
    if not value:
        return None
    path = Path(value)
    return path if path.is_absolute() else Path(os.path.normpath(root / ".dvc" / path))


def page_problem(root: Path) -> str | None:
    """Why `dvc plots show` cannot render into the configured page (and the command that writes it), or None."""
    page = template_of(root)
    if page is None:
        return None
    shown = os.path.relpath(page, root)
    if not page.is_file():
        return (
            f"{shown} (the offline page `dvc plots show` renders into) is missing: `{PAGE_COMMAND}` writes it"
        )
    if "{plot_divs}" not in page.read_text(errors="replace"):
        return f"{shown} is not a DVC page template (no {{plot_divs}}): `{PAGE_COMMAND}` writes it again"
    return None


def _show(args: argparse.Namespace) -> int:
    root = Path(".")
    problem = headline_problem(root) if args.view == "metrics" else page_problem(root)
    if problem is not None:
        print(f"tcnn show {args.view}: error: {problem}", file=sys.stderr)
        return 2
    dvc = shutil.which("dvc", path=str(Path(sys.executable).parent)) or shutil.which("dvc") or "dvc"
    sys.stdout.flush()
    os.execv(dvc, [dvc, args.view, "show", *args.dvc_args])
    return 0  # not reached


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "show",
        help="dvc metrics show / dvc plots show, after checking the files they need",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("view", choices=("metrics", "plots"))
    p.add_argument("dvc_args", nargs=argparse.REMAINDER, help="passed to DVC's command")
    p.set_defaults(func=_show)
