"""A stage's identity: everything its result depends on, as one JSON-able dict; its hash names the result.

Each stage module builds its identity with one function (`stages.pretrain.identity`, `stages.finetune.identity`
for the T-CNN and its matched control, `stages.corrupt.identity`), and the three places that ask "is this the
same result?" all call it:

- the DVC path's resume: a partial run (``runs/.partial/<stage>``) resumes only under the same identity (the
  ``run_hash`` core.training.loop.fit checks);
- the sweep's shared runs: a shared pretraining, matched control or corrupted-set directory under
  ``sweep.storage`` is named by :func:`key` of the identity (pipelines/sweep_plan.py);
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
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

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


def _closure(modules: Iterable[str]) -> set[ModuleType]:
    """The given modules and every project module their names come from, recursively (the import graph as the
    modules' namespaces bind it: the same whatever else the process loaded before)."""
    todo = [importlib.import_module(m) for m in modules]
    seen: set[ModuleType] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for value in vars(module).values():
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            if isinstance(name, str) and name.startswith(("core.", "stages.")) and name in sys.modules:
                todo.append(sys.modules[name])
    return seen


def network_code(stage: str, modules: Iterable[str], repo: Path = chain.REPO) -> dict[str, str]:
    """sha256 of each network-code file that ``modules`` (a kind's `ModelKind.code`) load and that dvc.yaml
    does not list for ``stage``.

    dvc.yaml lists the code of params.yaml's model kind; another kind (`-S model.kind=convit`) loads its own by
    reference, which DVC cannot see. A pretraining checkpoint records these files, and what starts from it
    (`stale_network_code`) refuses it once they changed, instead of DVC silently reusing it."""
    listed = set(chain.code_files(stage, repo))
    found: dict[str, str] = {}
    for module in _closure(modules):
        path = Path(module.__file__ or "").resolve()
        rel = str(path.relative_to(repo)) if path.is_relative_to(repo) else ""
        if rel.startswith(NETWORK_CODE) and rel not in listed and not rel.endswith("__init__.py"):
            found[rel] = file_digest(path)
    return dict(sorted(found.items()))


def stale_network_code(recorded: Mapping[str, str], repo: Path = chain.REPO) -> list[str]:
    """The files of ``recorded`` (`network_code`) whose content differs now, or that are gone."""
    return [
        rel
        for rel, digest in recorded.items()
        if not (repo / rel).is_file() or file_digest(repo / rel) != digest
    ]
