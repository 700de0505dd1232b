"""The DVC path's run protocol (:func:`stage_run`): every stage opens its workspace's parent run and its own
child, records the ids for the report, and closes both with the right status whatever ends it."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stages.harness import chain
from stages.harness.catalogue import stage_description
from stages.tracking.names import (
    CHAIN_TAG,
    DVC_EXP_TAG,
    DVC_LOCK_TAG,
    NOTE_TAG,
    PARAMS_HASH_TAG,
    RUN_NAME_TAG,
    SOURCE_NAME_TAG,
    UV_LOCK_FILE,
    UV_LOCK_TAG,
    RunStatus,
    digest_if_present,
    params_hash,
    run_label,
    workspace_key,
)
from stages.tracking.tracker import Tracker

RUN_IDS_FILE = Path(chain.RUN_IDS_FILE)  # the run ids of the current execution, for the report


def git_dirty(root: str | os.PathLike = ".") -> bool | None:
    """Whether tracked files other than the pipeline's own outputs differ from the checked-out commit
    (GitPython, MLflow's own git dependency; None outside git). MLflow's context tags name the commit, not
    whether the tree matched it. What `dvc repro` itself writes into tracked files (``dvc.lock``, the
    uncached metrics and plot tables of :func:`stages.harness.chain.outputs`) is no change of the user's: the
    first run of a fresh clone is clean, an edited params.yaml or module is not."""
    try:
        import git

        repo = git.Repo(root, search_parent_directories=True)
        diffs = [*repo.index.diff(None), *repo.index.diff("HEAD")]  # worktree vs index, index vs HEAD
        changed = {p for d in diffs for p in (d.a_path, d.b_path) if p}
    except Exception:  # no git executable, not a repository, no commit yet
        return None
    prefix = Path(root).resolve().relative_to(Path(repo.working_tree_dir).resolve())
    written = {str(prefix / p) for p in (chain.LOCK_FILE, *chain.all_outputs()) if "${" not in p}
    return any(not any(c == w or c.startswith(w + "/") for w in written) for c in changed)


def launch_command(max_depth: int = 8) -> str:
    """The command that ran this stage, for MLflow's ``mlflow.source.name``: the nearest ``dvc`` ancestor
    process (``dvc repro``, ``dvc exp run -S ...``), else this process's own command line."""
    import psutil

    proc = psutil.Process()
    try:
        for anc in proc.parents()[:max_depth]:
            words = anc.cmdline()
            at = next((i for i, w in enumerate(words) if Path(w).name == "dvc"), None)
            if at is not None:
                return " ".join(["dvc", *words[at + 1 :]])
        own = proc.cmdline()
    except psutil.Error:
        own = []
    if len(own) > 2 and own[1] == "-m":
        own = ["python", *own[1:]]
    return " ".join(own) or "python"


def record_run_ids(
    path: str | os.PathLike, parent: str, stage: str, run_id: str, meta: Mapping[str, Any] | None = None
) -> None:
    """Add ``stage``'s run id to the run-ids file of the current execution (atomically).

    Format: ``{"parent": id, "stages": {stage: id}, "meta": {...}}``; a file of another parent is replaced,
    so the file always describes one pipeline execution (read by the report stage)."""
    from core.utils.atomic import atomic_write_json

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("parent") != parent or not isinstance(data.get("stages"), dict):
        data = {"parent": parent, "stages": {}}
    data["stages"][stage] = run_id
    data["meta"] = {k: v for k, v in dict(meta or {}).items() if v is not None}
    atomic_write_json(path, data)


def _end_status(err: BaseException) -> RunStatus:
    """KILLED for an interruption the stage can resume from (Ctrl-C, a stop signal), else FAILED."""
    if isinstance(err, KeyboardInterrupt) or type(err).__name__ in ("Preempted", "Stopped"):
        return "KILLED"
    return "FAILED"


@contextlib.contextmanager
def stage_run(
    params: Any,
    stage: str,
    *,
    root: str | os.PathLike = ".",
    parent_name: str | None = None,
    parent_tags: Mapping[str, Any] | None = None,
    end_parent: bool = False,
    base_dir: str | os.PathLike | None = None,
    run_ids_file: str | os.PathLike | None = RUN_IDS_FILE,
    **child_kwargs: Any,
) -> Iterator[Tracker]:
    """The whole stage protocol in one call, for ``stages/<name>.py``::

        with stage_run(params, "finetune", root=root) as tracker:
            ...  # tracker.log_metrics(...), tracker.log_artifact(...)

    Parent: the *open* parent of this workspace (a chain whose last stage has not run: the earlier stages
    closed it, a failed or preempted stage interrupted it, or a SIGKILL left it RUNNING) when its params
    match; else a new one, named ``parent_name`` or the DVC experiment's name or :func:`run_label`, tagged
    as :func:`_parent_tags` says. The stage's child run logs all params, resumes a killed attempt, and ends
    FINISHED, and so does the parent: a process closes what it opened, whichever stage it ran (also one run
    by hand); on an exception the child and the parent end FAILED (KILLED when preempted), and the next run of
    the chain continues that parent. ``end_parent=True`` (the last stage) logs ``dvc.lock`` and
    ``params.yaml`` on the parent and marks the chain complete (:data:`CHAIN_TAG`), so the next execution
    opens a new parent. The ids go to ``run_ids_file`` (relative to ``root``; None: not written). The sqlite
    store resolves against ``base_dir``, default ``$DVC_ROOT`` (the main repository, also for
    ``dvc exp run --temp``) or ``root``.
    """
    root = Path(root)
    base = base_dir if base_dir is not None else (os.environ.get("DVC_ROOT") or root)
    tracker = Tracker.from_params(params, base_dir=base)
    if not tracker.enabled:
        yield tracker
        return
    exp_name = os.environ.get("DVC_EXP_NAME") or None
    name = parent_name or exp_name or run_label(params)
    tags = _parent_tags(params, root, name, exp_name, parent_tags)
    try:  # whatever ends the process (a failed store write, writing the run ids into a broken runs/) closes the runs
        tracker.start_parent(name, tags, key=workspace_key(root), params=params)
        parent = tracker.parent_run_id
        assert parent is not None
        _open_child(tracker, params, stage, root, parent, exp_name, run_ids_file, child_kwargs)
        yield tracker
    except BaseException as err:
        _close_failed(tracker, stage, err)
        raise
    _close_finished(tracker, root, parent, end_parent)


def _parent_tags(
    params: Any, root: Path, name: str, exp_name: str | None, parent_tags: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The parent's tags besides all params and MLflow's context tags (git commit, branch): its name, the
    command that ran it (:func:`launch_command`, MLflow's source name), ``tcnn.git_dirty``, the sha256 of
    ``dvc.lock`` (:data:`DVC_LOCK_TAG`, updated at every stage; at the end of the chain it is the lock of every
    stage but the last, which DVC records after the process exits) and of ``uv.lock``, under ``dvc exp run``
    the experiment's name (:data:`DVC_EXP_TAG`), :data:`PARAMS_HASH_TAG`, then ``parent_tags``."""
    return {
        RUN_NAME_TAG: name,
        SOURCE_NAME_TAG: launch_command(),
        "tcnn.git_dirty": git_dirty(root),
        DVC_LOCK_TAG: digest_if_present(root / "dvc.lock"),
        UV_LOCK_TAG: digest_if_present(root / UV_LOCK_FILE),
        DVC_EXP_TAG: exp_name,
        PARAMS_HASH_TAG: params_hash(params),
        **(parent_tags or {}),
    }


def _open_child(
    tracker: Tracker,
    params: Any,
    stage: str,
    root: Path,
    parent: str,
    exp_name: str | None,
    run_ids_file: str | os.PathLike | None,
    child_kwargs: dict[str, Any],
) -> None:
    """Log the environment on ``parent`` when this process created it, open the stage's child run (all params
    logged unless ``child_kwargs`` names others) and record its id with the tracking context in
    ``run_ids_file``."""
    if tracker.parent_created:
        tracker.log_environment(root, run_id=parent)
    child_kwargs.setdefault("params", params)
    child_kwargs["tags"] = {NOTE_TAG: stage_description(params, stage), **(child_kwargs.get("tags") or {})}
    child = tracker.start_child(stage, **child_kwargs)
    if run_ids_file is not None and child is not None:
        meta = {"experiment": tracker.experiment, "experiment_id": tracker.experiment_id,
                "tracking_uri": tracker.uri, "dvc_exp_name": exp_name}  # fmt: skip
        record_run_ids(root / run_ids_file, parent, stage, child, meta)


def _close_failed(tracker: Tracker, stage: str, err: BaseException) -> None:
    """After ``err`` ended the stage: tag the parent (if one was opened) with the stage and the error, and end
    the child and the parent FAILED (KILLED when resumable, :func:`_end_status`). The store may be what failed:
    its errors are swallowed here, and the caller re-raises ``err``."""
    status = _end_status(err)
    with contextlib.suppress(Exception):
        if (parent := tracker.parent_run_id) is not None:
            tracker.set_tags({"tcnn.failed_stage": stage, "tcnn.error": str(err)[:500]}, run_id=parent)
    for close in (tracker.end, tracker.end_parent):
        with contextlib.suppress(Exception):
            close(status)


def _close_finished(tracker: Tracker, root: Path, parent: str, end_parent: bool) -> None:
    """End the child and the parent FINISHED (every stage closes what it opened; the chain's next stage
    reopens the parent); with ``end_parent``, first :func:`_complete_chain`. A stop signal (or an error) while
    closing still leaves nothing RUNNING."""
    try:
        tracker.end("FINISHED")
        if end_parent:
            _complete_chain(tracker, root, parent)
        tracker.end_parent("FINISHED")
    except BaseException as err:
        with contextlib.suppress(Exception):
            tracker.end(_end_status(err))
            tracker.end_parent(_end_status(err))
        raise


def _complete_chain(tracker: Tracker, root: Path, parent: str) -> None:
    """The last stage's close: the parent gets the final ``dvc.lock`` digest and :data:`CHAIN_TAG` complete,
    loses the failure tags of an earlier interruption since continued, and logs ``dvc.lock`` and
    ``params.yaml``."""
    tracker.set_tags(
        {DVC_LOCK_TAG: digest_if_present(root / "dvc.lock"), CHAIN_TAG: "complete"}, run_id=parent
    )
    for tag in ("tcnn.failed_stage", "tcnn.error"):
        with contextlib.suppress(Exception):
            tracker.client.delete_tag(parent, tag)
    for name in ("dvc.lock", "params.yaml"):
        if (root / name).is_file():
            tracker.log_artifact(root / name, run_id=parent)
