"""Shared command-line plumbing for the stage modules: parse --params, validate, track, one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from core.config import ConfigError, Params, load_params, plan_epochs
from core.data.importers import DataError
from core.utils.hashing import file_digest
from core.utils.workspace import WorkspaceBusy, workspace_lock
from stages.harness import chain
from stages.harness.catalogue import (
    PARENT_ARTIFACTS,
    STAGE_DATASETS,
    STAGE_HISTORIES,
    STAGE_MODELS,
    epoch_metrics,
    final_model,
    headline_summary,
    parent_description,
    read_json,
    stage_artifacts,
    stage_metrics,
    summary_metrics,
)
from stages.harness.parent_watch import DVC_STAGE_ENV, end_with_dvc
from stages.harness.previous import kept_until_done
from stages.tracking.names import NOTE_TAG, run_label
from stages.tracking.store_faults import StoreFault


class StageError(RuntimeError):
    """A stage cannot run on its inputs (missing or corrupt checkpoint, bad data): one line, exit 2."""


#: Refusals of a stage's inputs (params, data, checkpoints): deterministic, so the same inputs are refused
#: again -- one line and exit 2 on the DVC path, a trial that fails once (is never retried) on the Ray path.
REFUSALS: tuple[type[Exception], ...] = (ConfigError, StageError, DataError)

EXIT_PREEMPTED = (
    75  # sysexits.h EX_TEMPFAIL: stopped, run the same command again (core.training.stop_signals)
)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the shell's status for Ctrl-C
EXIT_IOERR = 74  # sysexits.h EX_IOERR: a file or the tracking store could not be read or written
RANK_STATUS_ENV = (
    "TCNN_RANK_STATUS_DIR"  # where each torchrun rank records its exit status (stages.harness.training)
)
#: Signals that stop a stage process wherever it is: SIGINT (Ctrl-C), SIGTERM (kill, SLURM's time limit),
#: SIGHUP (the terminal went away), SIGUSR1/SIGUSR2 (SLURM --signal, submitit). Inside the training loop
#: its own handler (core.training.stop_signals.StopSignals) takes SIGTERM/SIGHUP/SIGUSR* first and checkpoints.
STAGE_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, n)
)


class Stopped(BaseException):
    """A stop signal outside the training loop (a BaseException, like KeyboardInterrupt: no ``except
    Exception`` swallows it). The runs end KILLED, workers are ended, the process exits 75 (130 for SIGINT)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_status(self) -> int:
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn :data:`STAGE_SIGNALS` into :class:`Stopped` in the main thread for the whole stage. The first
    signal raises; later ones are ignored, so the cleanup it starts (closing MLflow runs, ending workers)
    runs to its end."""
    raised = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Stopped(signum)

    handler.tcnn_stage_handler = True  # type: ignore[attr-defined]  # StopSignals.chain() skips it
    previous = {}
    for s in STAGE_SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # not the main thread: signals stay as they are
            previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, prev in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, prev)


def _causes(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__  # type: ignore[assignment]


def io_error_line(err: BaseException) -> str | None:
    """One line for a failed read or write (an OSError: full disk, read-only folder, a file where a folder
    should be, a dangling link) or a failed tracking store (a StoreFault: the sqlite store and what happened to
    it; another store's sqlalchemy error under MLflow), found anywhere in the exception's chain; None for other
    errors."""
    for e in _causes(err):
        if isinstance(e, StoreFault):  # the tracking store: what happened to its file
            return str(e)
        if isinstance(e, OSError):
            if e.filename is None:
                return str(e)
            names = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
            return f"{names}: {e.strerror or e}"
        if type(e).__module__.split(".")[0] == "sqlalchemy":
            orig = getattr(e, "orig", None) or e
            return f"tracking store: {orig} (tracking.uri; is another process holding it, or is it damaged?)"
    return None


def _recorded_changes(name: str, params_file: str) -> list[str] | None:
    """The params dvc.lock records for ``name``'s last run that differ now (``key: recorded value``); None when
    dvc.lock records no run of the stage (or cannot be read)."""
    try:
        lock = yaml.safe_load(Path(chain.LOCK_FILE).read_text()) or {}
        recorded = lock["stages"][name].get("params", {}).get(Path(params_file).name, {})
        values = yaml.safe_load(Path(params_file).read_text()) or {}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    changed = []
    for key, old in (recorded or {}).items():
        node: Any = values
        for part in str(key).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != old:
            shown = "as dvc.lock records it" if isinstance(old, (dict, list)) else f"{old!r}"
            changed.append(f"{key}: {shown}")
    return changed


def _under_dvc_hint(name: str, params_file: str) -> str:
    """For a refused params value under DVC, which removed the stage's outputs before starting it: how they
    come back (DVC's run cache holds every output of a run, ``cache: false`` ones too) -- only when dvc.lock
    records an earlier run whose value differs (it names it); a value with no earlier one (a param the stage's
    last run did not have, a first run) gets no such advice."""
    if not os.environ.get(DVC_STAGE_ENV):
        return ""
    changed = _recorded_changes(name, params_file)
    if not changed:
        return ""
    return (
        f" (put the value back and run dvc repro: DVC's run cache restores this stage's outputs; its last run "
        f"had {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''})"
    )


def _removed_by_dvc(name: str, params_file: str) -> str:
    """For a stage DVC started on a busy workspace: the stage's outputs that are gone (DVC removes them before
    it starts the stage, so before the workspace lock can refuse) and the command that brings them back from
    DVC's cache."""
    if not os.environ.get(DVC_STAGE_ENV):
        return ""
    try:
        values = yaml.safe_load(Path(params_file).read_text()) or {}
        gone = [p for o in chain.outputs(name) if not Path(p := chain.resolve(o, values)).exists()]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return ""
    if not gone:
        return ""
    return (
        f"; DVC removed this stage's outputs before starting it ({', '.join(gone)}): "
        f"once that run is done, `dvc checkout {name}` brings them back"
    )


def tracking_on(params: Params) -> bool:
    """Tracking is on unless ``tracking.enabled: false`` or ``TCNN_TRACKING=0`` (the test-suite sets it)."""
    return params.tracking.enabled and os.environ.get("TCNN_TRACKING", "1") != "0"


@contextlib.contextmanager
def _tracked(params: Params, name: str) -> Iterator[Any]:
    """The stage's MLflow run (child of the pipeline's parent run), or nothing when tracking is off."""
    if not tracking_on(params) or int(os.environ.get("RANK", "0") or 0) != 0:  # one run: DDP rank 0's
        yield None
        return
    from stages.harness.stage_run import (
        stage_run,  # the tracking adapter's stage protocol; stages work without it
    )

    with stage_run(
        params, name, root=".", end_parent=name == chain.last_stage(), system_metrics=True
    ) as tracker:
        yield tracker


def _one_writer(name: str) -> contextlib.AbstractContextManager:
    """The workspace lock (core.utils.workspace) for a stage process: a second stage process on this
    workspace is refused with one line naming the holder. The ranks of a data-parallel stage (started by the
    stage process, which holds the lock while they run) do not take it."""
    if int(os.environ.get("RANK", "0") or 0) != 0 or os.environ.get(RANK_STATUS_ENV):
        return contextlib.nullcontext()  # a rank of our own torchrun: the launching process holds the lock
    return workspace_lock(".", f"python -m stages.{name}")


def _kept(name: str, params: Params) -> contextlib.AbstractContextManager:
    """The stage's outputs as they were unless its run, logging and MLflow close all succeed
    (stages.harness.previous); a rank of our own torchrun leaves that to the launching process."""
    if int(os.environ.get("RANK", "0") or 0) != 0 or os.environ.get(RANK_STATUS_ENV):
        return contextlib.nullcontext()
    return kept_until_done(name, params.model_dump(mode="json"))


def log_history(tracker: Any, path: Path, step_key: str = "epoch") -> int:
    """Per-epoch metrics of a training history (``history.json``: a list of rows) with step = the epoch."""
    rows = read_json(path)
    if not isinstance(rows, list):
        return 0
    n = 0
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get(step_key, row.get("epoch")), int):
            step = int(row.get(step_key, row.get("epoch")))
            tracker.log_metrics(epoch_metrics(row), step=step)
            n += 1
    return n


def log_dataset_dir(tracker: Any, name: str, data_dir: Path, context: str) -> None:
    """A prepared dataset as an MLflow input: digest = sha256 of its manifest (which holds every file's sha256)."""
    manifest = data_dir / "manifest.json"
    if not manifest.is_file():
        return
    digest = file_digest(manifest)
    info = read_json(manifest) or {}
    profile = {k: info.get(k) for k in ("num_classes", "image_shape", "class_counts") if k in info}
    profile["manifest_sha256"] = digest
    tracker.log_dataset(name, digest, str(data_dir), context=context, profile=profile)


def log_corrupted_sets(tracker: Any, params: Params, root: Path) -> None:
    """The corrupted test sets as an MLflow input: digest = sha256 of their index (one sha256 per set)."""
    index = root / params.robustness.dir / "index.json"
    if index.is_file():
        digest = file_digest(index)
        info = read_json(index) or {}
        profile = {"n_images": info.get("n"), "sets": len(info.get("sets") or []), "index_sha256": digest}
        tracker.log_dataset(f"{params.data.name}-c", digest, str(root / params.robustness.dir),
                            context="test-corrupted", profile=profile)  # fmt: skip


def source_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """MLflow tags naming an imported CNN (pretrain's metrics): file, sha256, arch, normalization, and whether
    its classifier was replaced."""
    src, norm = metrics.get("source") or {}, metrics.get("normalization") or {}
    return {
        "tcnn.cnn_source": str(src.get("weights")),
        "tcnn.cnn_source_sha256": str(src.get("sha256")),
        "tcnn.cnn_source_arch": str(src.get("arch")),
        "tcnn.cnn_normalization": f"{norm.get('from')}: mean {norm.get('mean')} std {norm.get('std')}",
        "tcnn.classifier_replaced": "; ".join(metrics.get("notes") or []) or "no",
    }


def _log_outputs(tracker: Any, params: Params, name: str, metrics: Any, root: Path = Path(".")) -> None:
    """Everything a finished stage leaves for MLflow: metrics, per-epoch metrics, artifacts, datasets, models;
    the last stage also logs the summary metrics on the parent run."""
    if tracker is None:
        return
    tracker.log_metrics(stage_metrics(name, metrics))
    if isinstance(metrics, dict) and metrics.get("imported"):  # the CNN's origin, on the stage and its parent
        tags = source_tags(metrics)
        tracker.set_tags(tags)
        tracker.set_tags(tags, run_id=tracker.parent_run_id)
    if name in STAGE_HISTORIES:
        log_history(tracker, root / chain.output(name, "history.json"), STAGE_HISTORIES[name])
    for context in STAGE_DATASETS.get(name, ()):
        if context == "test-corrupted":
            log_corrupted_sets(tracker, params, root)
        else:
            log_dataset_dir(tracker, params.data.name, root / params.data.dir, context)
    values = params.model_dump(mode="json")
    for path, folder in stage_artifacts(name, values, root):
        tracker.log_artifact(path, folder)
    if name in STAGE_MODELS and (ckpt := final_model(name, values, root)) is not None:
        tracker.log_checkpoint_model(ckpt, STAGE_MODELS[name])
    if name == chain.last_stage():
        parent = tracker.parent_run_id
        tracker.log_metrics(summary_metrics(root) | headline_summary(root), run_id=parent)
        label = os.environ.get("DVC_EXP_NAME") or run_label(params)
        tracker.set_tags({NOTE_TAG: parent_description(label, root)}, run_id=parent)
        for stage, file_name in PARENT_ARTIFACTS:
            if (path := root / chain.output(stage, file_name)).is_file():
                tracker.log_artifact(path, run_id=parent)


def stage_main(
    name: str,
    run: Callable[[Params], object],
    argv: list[str] | None = None,
    *,
    data_parallel: Callable[[Params, str, list[str]], contextlib.AbstractContextManager] | None = None,
    check: Callable[[Params], None] | None = None,
    tracked: bool = True,
) -> int:
    """Parse, validate, run and track a stage. `check` (raising StageError) runs before anything is opened or
    written: what can be known to fail from the params and the inputs on disk fails there, not after the
    MLflow runs were opened. `data_parallel` (the training stages pass stages.harness.training.data_parallel) wraps
    the run: it may relaunch the stage as several DDP processes. `tracked` false: no MLflow run (a check that
    computes nothing, stages/check.py)."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="override a param"
    )
    args = parser.parse_args(argv)
    code = _stage(name, run, args, argv, data_parallel, check, tracked)
    where = os.environ.get(RANK_STATUS_ENV)
    if where:  # a torchrun rank: the launching process exits with the ranks' common status
        with contextlib.suppress(OSError):
            Path(where, f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))
    return code


def _stage(
    name: str,
    run: Callable[[Params], object],
    args: argparse.Namespace,
    argv: list[str] | None,
    data_parallel: Callable[[Params, str, list[str]], contextlib.AbstractContextManager] | None,
    check: Callable[[Params], None] | None,
    tracked: bool = True,
) -> int:
    with stop_on_signals(), end_with_dvc():
        try:
            params = plan_epochs(load_params(args.params, args.set))  # epochs x 1/f, as the sweeps plan them
            if check is not None:
                check(params)
            args_list = sys.argv[1:] if argv is None else list(argv)
            launch = data_parallel(params, name, args_list) if data_parallel else contextlib.nullcontext()
            track = _tracked(params, name) if tracked else contextlib.nullcontext()
            with _one_writer(name), launch, _kept(name, params), track as tracker:
                metrics = run(params)
                _log_outputs(tracker, params, name, metrics)
        except Stopped as stop:
            print(f"{name}: stopped by {stop}; run the same command again to continue", file=sys.stderr)
            return stop.exit_status
        except ConfigError as err:
            print(f"{name}: error: {err}{_under_dvc_hint(name, args.params)}", file=sys.stderr)
            return 2
        except WorkspaceBusy as err:
            print(f"{name}: error: {err}{_removed_by_dvc(name, args.params)}", file=sys.stderr)
            return 2
        except (StageError, DataError) as err:
            print(f"{name}: error: {err}{_under_dvc_hint(name, args.params)}", file=sys.stderr)
            return 2
        except Exception as err:
            if type(err).__name__ == "TrackingError":  # stages.tracking.store's; MLflow is not imported here
                print(f"{name}: error: {err}", file=sys.stderr)
                return 2
            if (
                type(err).__name__ == "Preempted"
            ):  # core.training.stop_signals.Preempted: checkpointed, resumable
                print(f"{name}: {err}", file=sys.stderr)
                return EXIT_PREEMPTED
            if (line := io_error_line(err)) is None:
                raise
            print(f"{name}: error: {line}", file=sys.stderr)
            return EXIT_IOERR
    return 0
