"""The chain of stages as `dvc.yaml` states it, the one place the graph is written down: the stage order, the
last stage, and the code each stage depends on. The report, the MLflow adapter and the sweep read it here
instead of restating it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CODE_PACKAGES = ("core/", "stages/")


@cache
def _stages(repo: Path = REPO) -> dict[str, dict[str, Any]]:
    return yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]


def stage_names(repo: Path = REPO) -> tuple[str, ...]:
    """The stages in dvc.yaml's order (a topological order of the chain)."""
    return tuple(_stages(repo))


def last_stage(repo: Path = REPO) -> str:
    """The stage that ends a pipeline execution (it closes the MLflow parent run)."""
    return stage_names(repo)[-1]


def code_files(stage: str, repo: Path = REPO) -> list[str]:
    """The code files (under core/ and stages/) that dvc.yaml lists as deps of ``stage``, folders expanded to
    their .py files: the code part of DVC's own identity of the stage (tests/test_dvc_deps.py keeps those deps
    complete)."""
    files: set[str] = set()
    for d in _stages(repo)[stage]["deps"]:
        if not isinstance(d, str) or not d.startswith(CODE_PACKAGES):
            continue
        path = repo / d
        found = path.rglob("*.py") if path.is_dir() else [path]
        files |= {str(p.relative_to(repo)) for p in found if "__pycache__" not in p.parts}
    return sorted(files)
