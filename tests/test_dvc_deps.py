"""DVC deps that cannot drift: every file of science or stage code a stage imports is among its deps in
dvc.yaml (checked on the static import graph, function-level imports included), and editing any such file
makes `dvc status` report the stage changed (checked on a real DVC project)."""

from __future__ import annotations

import ast
import json
import re
import shutil
from functools import cache
from pathlib import Path

import grimp
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "stages")  # science and stage code; pipelines/ (sweeps, SLURM) is not a stage input
#: Stage code that reports a run to MLflow and never changes what a stage writes: not a DVC input (editing the
#: tracking adapter must not invalidate every cached stage), and neither is what only it imports (loading a
#: checkpoint's model to log it to MLflow).
REPORTING_ONLY = {
    "stages/tracking/tracker.py",
    "stages/tracking/names.py",
    "stages/harness/stage_run.py",
    "stages/harness/catalogue.py",
}


def _stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@cache
def _graph() -> grimp.ImportGraph:
    """The static import graph of core/ and stages/ without the reporting-only modules."""
    graph = grimp.build_graph(  # imports under TYPE_CHECKING never run: not an input
        *PACKAGES, include_external_packages=False, exclude_type_checking_imports=True, cache_dir=None
    )
    for rel in REPORTING_ONLY:
        graph.remove_module(rel.removesuffix(".py").replace("/", "."))
    return graph


def _file(module: str) -> str:
    path = REPO / module.replace(".", "/")
    return f"{path.relative_to(REPO)}/__init__.py" if path.is_dir() else f"{path.relative_to(REPO)}.py"


def _docstring_only(rel: str) -> bool:
    body = ast.parse((REPO / rel).read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def kind_code(stage: str) -> tuple[str, ...]:
    """The modules of params.yaml's model kind that the stage loads by reference (`ModelKind.code`): the
    pretraining network's or the final one's, as the stage's ``meta.builds`` says (none: it builds no network)."""
    from core.models import kinds

    builds = (_stages()[stage].get("meta") or {}).get("builds")
    kind = kinds.get(yaml.safe_load((REPO / "params.yaml").read_text())["model"]["kind"])
    if builds is None:
        return ()
    assert builds in ("pretraining", "final"), f"{stage}: meta.builds {builds!r}"
    return (kind.pretraining_record() if builds == "pretraining" else kind).code()


def imported_files(stage: str) -> set[str]:
    """The source files `python -m stages.<stage>` may import from core/ and stages/ (the whole static
    closure, imports inside functions included, and the kind code it loads by reference), package __init__
    files that hold only a docstring left out."""
    g = _graph()
    roots = {f"stages.{stage}", *kind_code(stage)}
    modules = set(roots).union(*(g.find_upstream_modules(r) for r in roots))
    files = {_file(m) for m in modules if m.split(".")[0] in PACKAGES}
    files |= {f"{p}/__init__.py" for p in PACKAGES}
    return {f for f in files if not (f.endswith("__init__.py") and _docstring_only(f))}


def _covered(rel: str, deps: list[str]) -> bool:
    return any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.mark.parametrize("stage", list(_stages()))
def test_stage_deps_cover_every_imported_file(stage: str) -> None:
    spec = _stages()[stage]
    assert spec["cmd"] == f"scripts/stage {stage}"
    deps = [d for d in spec["deps"] if isinstance(d, str)]
    files = imported_files(stage)
    assert f"stages/{stage}.py" in files and "core/config/params.py" in files
    missing = sorted(f for f in files if not _covered(f, deps))
    assert not missing, f"dvc.yaml stage {stage!r} lacks deps for {missing}"


ATTENTION_CODE = ("core/nn/gpsa.py", "core/nn/gpsa_tcnn.py", "core/nn/psa.py", "core/models/conversion.py")
#: The stages that train or evaluate the plain CNN, and the data's (and its check): they never load attention
#: code, so an edit of GPSA costs no pretraining (hours of a real study); the others build the T-CNN.
CNN_ONLY = {"prepare", "check", "pretrain", "control", "corrupt"}


def test_attention_code_is_an_input_only_of_the_stages_that_build_the_tcnn() -> None:
    """The kind registry names its code by reference and the control shares no module with the finetune
    stage that imports attention code, so (for params.yaml's kind) the CNN's pretraining, its control, the data
    and the corrupted sets never import GPSA; every stage that lists the attention code imports it."""
    for rel in ATTENTION_CODE:
        users = {s for s in _stages() if rel in imported_files(s)}
        listing = {
            s
            for s, spec in _stages().items()
            if _covered(rel, [d for d in spec["deps"] if isinstance(d, str)])
        }
        assert listing == users, rel
        assert users == set(_stages()) - CNN_ONLY, rel
    assert "core/config/params.py" in imported_files("prepare") and not any(
        f.startswith(("core/nn/", "core/models/", "core/training/")) for f in imported_files("prepare")
    )


def test_package_roots_hold_no_code_but_the_stages_startup_handler() -> None:
    """The package roots with code are deps of every stage: stages/__init__.py holds the stop-signal handler of
    a stage's first seconds (`python -m stages.<name>` imports it first); core/__init__.py registers the
    science's answers to the config's questions (core.config.rules), loaded by reference: no stage's static
    imports reach a ``config_rules`` module, so the CNN-only stages keep their model-free deps (above)."""
    for root in ("core/__init__.py", "stages/__init__.py"):
        assert not _docstring_only(root)
        assert all(root in spec["deps"] for spec in _stages().values()), root
    assert not any(f.endswith("/config_rules.py") for s in _stages() for f in imported_files(s))


@pytest.mark.slow
def test_editing_a_file_or_folder_dep_or_the_gpsa_code_makes_dvc_status_report_the_stages(
    tmp_path_factory, tmp_path
) -> None:
    """On a finished tiny `dvc repro`, append a comment to a file, then restore it: `dvc status` must report
    exactly the stages whose imports include it. Three edits: a file dep, a file under a folder dep (that every
    imported file is among its stages' deps is checked statically above; this checks that DVC acts on both
    forms), and the GPSA layer, which must rerun reparam, finetune, evaluate and report and not prepare,
    pretrain, control or corrupt."""
    from _pipeline_repo import built_repo, dvc

    repo = tmp_path / "repo"
    shutil.copytree(built_repo(tmp_path_factory), repo, symlinks=True)
    assert json.loads(dvc(repo, "status", "--json").stdout or "{}") == {}
    folder_dep = next(d for d in _stages()["pretrain"]["deps"] if isinstance(d, str) and (REPO / d).is_dir())
    picked = (
        "stages/harness/chain.py",
        next(f for f in sorted(imported_files("pretrain")) if f.startswith(folder_dep)),
    )
    for rel in (*picked, "core/nn/gpsa.py"):
        stages = {s for s in _stages() if rel in imported_files(s)}
        path = repo / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n# edited by test_dvc_deps\n")
        try:
            status = json.loads(dvc(repo, "status", "--json").stdout or "{}")
        finally:
            path.write_bytes(original)
        assert set(status) == stages, (
            f"editing {rel}: dvc status reports {sorted(status)}, expected {sorted(stages)}"
        )
    assert {s for s in _stages() if "core/nn/gpsa.py" in imported_files(s)} == {
        "reparam",
        "finetune",
        "evaluate",
        "report",
    }


def _outs(stage: dict) -> list[tuple[str, bool]]:
    """(path, git-tracked?) of a stage's outs and metrics: `cache: false` ones belong in git."""
    found = []
    for section in ("outs", "metrics", "plots"):
        for item in stage.get(section, []):
            path, opts = next(iter(item.items())) if isinstance(item, dict) else (item, {})
            found.append((path, (opts or {}).get("cache", True) is False))
    return found


def test_git_tracks_exactly_the_uncached_outs() -> None:
    """Metrics and plot tables are `cache: false` and git-tracked (experiment commits carry them, so `dvc exp
    show` and `dvc plots diff` have something to compare); every cached out stays git-ignored."""
    import subprocess

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    outs = [(p, tracked) for s in _stages().values() for p, tracked in _outs(s)]

    def resolve(path: str) -> str:  # DVC's ${section.key} templating, from params.yaml
        return re.sub(r"\$\{(\w+)\.(\w+)\}", lambda m: params[m[1]][m[2]], path)

    paths = [resolve(p) for p, _ in outs]
    probe = [p if Path(p).suffix else f"{p}/probe" for p in paths]  # a folder out: a file inside it
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(probe), capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert any(tracked for _, tracked in outs) and not all(tracked for _, tracked in outs)
    for (path, tracked), p in zip(outs, probe):
        assert (p in ignored) != tracked, f"{path}: {'ignored by git' if tracked else 'not ignored by git'}"
