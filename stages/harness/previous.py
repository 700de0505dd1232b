"""A stage's outputs are the last run's that finished, or nothing: never those of a run that failed after it
wrote them (a tracking store that failed while the stage logged them, exit 74; a stop signal; an error).

:func:`kept_until_done` moves the stage's earlier outputs aside into ``runs/.previous/<stage>/`` (a rename:
what `dvc repro` does anyway, which removes a stage's outs before it starts it), lets the stage write and log
its own, and when anything ends the stage before its MLflow runs closed FINISHED, removes what the run wrote
and moves the earlier outputs back. On success the earlier ones are deleted. A run killed with SIGKILL leaves
``runs/.previous/<stage>/`` behind: the next start of the stage first puts those back in place of what the
killed run had written.

Training stages are not wrapped: their outputs are published from the resume state (stages.harness.training
.publish) whose work folder is then removed, so removing their published outputs would throw the training away
(they stay; dvc.lock does not record them, so the next `dvc repro` runs the stage again). Outs that DVC keeps
across runs (``persist: true``: the corrupted sets, which corrupt extends set by set) are not moved either.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.harness import chain

#: Where a running stage keeps the outputs of its last finished run: ``<PREVIOUS>/<stage>/<out path>``.
PREVIOUS = "runs/.previous"


def guarded_outputs(stage: str, values: dict[str, Any]) -> list[str]:
    """The stage's outputs that :func:`kept_until_done` moves aside (dvc.yaml's outs and metrics, placeholders
    filled from ``values``, a params mapping), none for a training stage and none that DVC persists."""
    if chain.trains(stage):
        return []
    return [chain.resolve(o, values) for o in chain.outputs(stage) if o not in chain.persistent(stage)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _put_back(keep: Path, root: Path, outs: list[str]) -> None:
    """Replace each of ``outs`` by its copy under ``keep`` (or by nothing when it had none), then drop ``keep``."""
    for rel in outs:
        _remove(root / rel)
        if (kept := keep / rel).exists() or kept.is_symlink():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            kept.rename(root / rel)
    shutil.rmtree(keep, ignore_errors=True)
    with contextlib.suppress(OSError):
        keep.parent.rmdir()  # runs/.previous when no other stage keeps anything there


@contextlib.contextmanager
def kept_until_done(stage: str, values: dict[str, Any], root: Path = Path(".")) -> Iterator[None]:
    """Around a stage's run, its logging and the close of its MLflow runs (module docstring): on any exception
    (a BaseException too: a stop signal) the stage's outputs are as they were before it started."""
    outs = guarded_outputs(stage, values)
    keep = root / PREVIOUS / stage
    if not outs:
        yield
        return
    if keep.is_dir():  # left by a run killed with SIGKILL: its outputs are partial, the kept ones are whole
        _put_back(keep, root, outs)
    for rel in outs:
        if (root / rel).exists() or (root / rel).is_symlink():
            (keep / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).rename(keep / rel)
    try:
        yield
    except BaseException:
        _put_back(keep, root, outs)
        raise
    shutil.rmtree(keep, ignore_errors=True)
    with contextlib.suppress(OSError):
        keep.parent.rmdir()
