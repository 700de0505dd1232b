"""A stage's identity: everything its result depends on, as one JSON-able dict; its hash names the result.

Each stage module builds its identity with one function (`stages.pretrain.identity`, `stages.finetune.identity`
for the T-CNN and its matched control, `stages.corrupt.identity`), and the three places that ask "is this the
same result?" all call it:

- the DVC path's resume: a partial run (``runs/.partial/<stage>``) resumes only under the same identity (the
  ``run_hash`` core.training.loop.fit checks);
- the sweep's shared runs: a shared pretraining, matched control or corrupted-set directory under
  ``sweep.storage`` is named by :func:`key` of the identity (pipelines/sweep/plan.py);
- the corrupted-set cache: every stored set carries the key of the corrupt stage's identity and is reused
  only under the same key.

What every identity holds is added here: the stage, its inputs' content (a file's or an upstream identity's
hash), the device and how the run executes (a training stage passes stages.harness.training.execution_identity), and
its code: the files dvc.yaml lists as the stage's deps (stages.harness.chain.code_files), as DVC itself hashes them.
This module imports no science, so the stages that train nothing (corrupt) can use it without depending on
torch code.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from core.utils import module_files
from core.utils.hashing import file_digest, stable_hash
from stages.harness import chain

VERSION = 2  # the layout of an identity; bumping it renames every shared directory and voids partial runs


def code_digest(stage: str, repo: Path = chain.REPO) -> str:
    """sha256 over the code files dvc.yaml lists as deps of ``stage`` (path and bytes of each, in order)."""
    h = hashlib.sha256()
    for rel in chain.code_files(stage, repo):
        h.update(rel.encode())
        h.update((repo / rel).read_bytes())
    return h.hexdigest()


def stage_identity(
    stage: str,
    parts: Mapping[str, Any],
    *,
    inputs: Mapping[str, Any],
    device: str | None = None,
    execution: Mapping[str, Any] | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The identity of ``stage``: its own ``parts`` (the params it reads, as the stage module picks them) plus
    the common fields. ``device``/``execution``: where and how a training run executes (None for a stage
    that runs no network); ``code``: the code's identity when the stage versions its code itself (default:
    the digest of its dvc.yaml code deps)."""
    return {
        "version": VERSION,
        "stage": stage,
        **parts,
        "inputs": dict(inputs),
        **({"device": device} if device is not None else {}),
        **(execution or {}),
        "code": code if code is not None else code_digest(stage),
    }


def key(identity: Mapping[str, Any]) -> str:
    """The short name of an identity (16 hex digits of its stable hash): a shared directory's name."""
    return stable_hash(dict(identity))[:16]


#: The network code a model kind loads by reference (`core.models.kinds.ModelKind.code`).
NETWORK_CODE = ("core/models/", "core/nn/")
#: The project's own packages: a kind's code is followed through them only.
PROJECT_MODULES = ("core.", "stages.")
#: The key prefix of an installed distribution in `network_code` (its value: the version).
DISTRIBUTION = "dist:"


def _in_project(module: ModuleType) -> bool:
    return module.__name__.startswith(PROJECT_MODULES)


def _recorded(rel: str, listed: set[str]) -> bool:
    """Whether `network_code` records the local file ``rel``: not among the stage's dvc.yaml code deps; in the
    project's packages, only network code (package roots are docstrings or lazy loaders); any other file (a
    builder's own package, in the workspace or on PYTHONPATH) whole."""
    if rel in listed:
        return False
    if rel.startswith(chain.CODE_PACKAGES):
        return rel.startswith(NETWORK_CODE) and not rel.endswith("__init__.py")
    return True


def _relative(path: Path, repo: Path) -> str:
    """``path`` relative to the workspace, or absolute outside it (a PYTHONPATH folder)."""
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def builder_code(module: str, repo: Path = chain.REPO) -> dict[str, str]:
    """The code of a user's builder module (`core.models.builders`, imported already): sha256 of each local
    file it runs (`core.utils.module_files.local_files`: the module, its packages, the local modules it
    imports), by path relative to ``repo`` (absolute outside it); an installed module (``torchvision.models``)
    is named by its distribution instead, ``{"dist:torchvision": version}`` (installed from uv.lock)."""
    if module_files.is_local(importlib.import_module(module)):
        return {_relative(f, repo): file_digest(f) for f in module_files.local_files(module)}
    dist = module_files.distribution(module)
    return {} if dist is None else {f"{DISTRIBUTION}{dist[0]}": dist[1]}


def network_code(
    stage: str, modules: Iterable[str], repo: Path = chain.REPO, builder: str | None = None
) -> dict[str, str]:
    """sha256 of each network-code file that ``modules`` (a kind's `ModelKind.code`) and the ``builder`` module
    (`builder_code`, when model.arch names one) load and that dvc.yaml does not list for ``stage``.

    dvc.yaml lists the code of params.yaml's model kind; another kind (`-S model.kind=convit`) loads its own by
    reference, which DVC cannot see, and a builder's module reaches DVC only through ``model.code``. A
    pretraining checkpoint records these files, and what starts from it (`stale_network_code`) refuses it
    once they changed, instead of silently reusing it (a sweep, which runs without DVC, names its shared
    pretraining by them: `stages.pretrain.identity`)."""
    listed = set(chain.code_files(stage, repo))
    files = (module_files.source_file(m) for m in module_files.closure(modules, _in_project))
    kind_files = {str(f.relative_to(repo)) for f in files if f is not None and f.is_relative_to(repo)}
    found = {rel: file_digest(repo / rel) for rel in kind_files if _recorded(rel, listed)}
    if builder is not None:
        found.update({k: v for k, v in builder_code(builder, repo).items() if _recorded(k, listed)})
    return dict(sorted(found.items()))


def _current(key: str, repo: Path) -> str | None:
    """What ``key`` of `network_code` is now: a file's sha256, a distribution's version (None: gone)."""
    if key.startswith(DISTRIBUTION):
        try:
            return importlib.metadata.version(key.removeprefix(DISTRIBUTION))
        except importlib.metadata.PackageNotFoundError:
            return None
    path = repo / key
    return file_digest(path) if path.is_file() else None


def stale_network_code(recorded: Mapping[str, str], repo: Path = chain.REPO) -> list[str]:
    """The entries of ``recorded`` (`network_code`) that differ now: files whose content changed or that are
    gone, distributions of another version or uninstalled."""
    return [key for key, value in recorded.items() if _current(key, repo) != value]
