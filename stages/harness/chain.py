"""The chain of stages as `dvc.yaml` states it, the one place the graph is written down: the stage order, the
last stage, the code each stage depends on, and (in each stage's ``meta``, which DVC ignores) how a sweep runs
it and whether it trains. The report, the MLflow adapter and the sweep read it here instead of restating it.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
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


def outputs(stage: str, repo: Path = REPO) -> tuple[str, ...]:
    """The stage's outs and metrics files as dvc.yaml writes them (``${...}`` left for :func:`resolve`)."""
    spec = _stages(repo)[stage]
    entries = [*spec.get("outs", []), *spec.get("metrics", [])]
    return tuple(next(iter(e)) if isinstance(e, dict) else e for e in entries)


def persistent(stage: str, repo: Path = REPO) -> tuple[str, ...]:
    """The stage's outs that DVC keeps across runs (``persist: true``), as dvc.yaml writes them."""
    outs = _stages(repo)[stage].get("outs", [])
    return tuple(k for e in outs if isinstance(e, dict) for k, v in e.items() if (v or {}).get("persist"))


#: DVC's record of the pipeline's state, rewritten by `dvc repro` (git-tracked).
LOCK_FILE = "dvc.lock"


def all_outputs(repo: Path = REPO) -> tuple[str, ...]:
    """Every stage's outs and metrics (:func:`outputs`), in stage order."""
    return tuple(o for stage in stage_names(repo) for o in outputs(stage, repo))


def metrics_file(stage: str, repo: Path = REPO) -> str:
    """The stage's metrics file: the out its ``meta.metrics_file`` in dvc.yaml names. (DVC's own ``metrics:``
    section holds only the headline, so that `dvc metrics show` stays readable.)"""
    path = (_stages(repo)[stage].get("meta") or {}).get("metrics_file")
    if path not in outputs(stage, repo):
        raise KeyError(f"dvc.yaml: stage {stage!r} names no metrics_file among its outs")
    return path


def headline_dir(repo: Path = REPO) -> str:
    """The folder of the headline's files (core.robustness.headline): dvc.yaml's one ``metrics:`` entry."""
    (entry,) = [e for spec in _stages(repo).values() for e in spec.get("metrics", [])]
    return next(iter(entry)) if isinstance(entry, dict) else entry


def output(stage: str, name: str, repo: Path = REPO) -> str:
    """The stage's output whose file name is ``name`` (``history.json``...)."""
    (found,) = [o for o in outputs(stage, repo) if Path(o).name == name]
    return found


#: Where a training stage keeps its partial state while it runs (outside DVC's outs, which DVC deletes before
#: a stage runs): ``<PARTIAL>/<stage>``.
PARTIAL = "runs/.partial"
#: The run ids of the current pipeline execution (git-ignored, no stage's dep or out), for the report.
RUN_IDS_FILE = "runs/mlflow_runs.json"


def run_dir(stage: str, repo: Path = REPO) -> str:
    """The folder that holds the stage's outputs (``runs/pretrain``, ``results``...)."""
    parents = [str(Path(o).parent) for o in outputs(stage, repo) if "${" not in o]
    return os.path.commonpath(parents)


def partial_dir(stage: str) -> str:
    """Where the stage keeps its partial state while it runs (:data:`PARTIAL`)."""
    return f"{PARTIAL}/{stage}"


def resolve(path: str, params: dict[str, Any]) -> str:
    """``path`` with DVC's ``${section.key}`` placeholders filled from ``params`` (a params.yaml mapping)."""

    def value(match: re.Match[str]) -> str:
        node: Any = params
        for part in match.group(1).split("."):
            node = node[part]
        return str(node)

    return re.sub(r"\$\{([^}]+)\}", value, path)


#: How a sweep treats a stage (dvc.yaml ``meta.sweep``): ``input`` must exist before the sweep (the prepared
#: data); ``sweep``: the driver builds it once per identity before any trial; ``group``: once per identity,
#: by the first trial that needs it, shared by the others; ``trial``: in every trial's directory;
#: ``summary``: the sweep's own summary takes its place.
SWEEP_ROLES = ("input", "sweep", "group", "trial", "summary")


def sweep_role(stage: str, repo: Path = REPO) -> str:
    role = (_stages(repo)[stage].get("meta") or {}).get("sweep")
    if role not in SWEEP_ROLES:
        raise ValueError(f"dvc.yaml: stage {stage!r} has meta.sweep {role!r}, expected one of {SWEEP_ROLES}")
    return role


def trains(stage: str, repo: Path = REPO) -> bool:
    """A training stage (dvc.yaml ``meta.trains``): it resumes from ``runs/.partial/<stage>`` and runs data
    parallel under Ray Train; the others run in the trial's own process."""
    return bool((_stages(repo)[stage].get("meta") or {}).get("trains"))


def trial_stages(repo: Path = REPO) -> tuple[str, ...]:
    """The stages a sweep trial runs, in the chain's order: its own (``trial``) and the shared ones it needs
    (``group``)."""
    return tuple(s for s in stage_names(repo) if sweep_role(s, repo) in ("group", "trial"))
