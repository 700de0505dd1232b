"""One sweep trial: the DVC chain's stage functions in the trial's directory, the stages and their order read
from dvc.yaml (`stages.harness.chain.trial_stages`: pretrain -> reparam -> finetune -> control -> evaluate by default).

Runs inside a Ray Tune function trainable. Its directory ``<sweep>/trials/<tid>/`` is the ``root`` of every
stage call (runs/..., results/...), with ``runs/pretrain`` a link to the shared pretraining of its group,
``runs/control`` a link to the shared matched control (pipelines/sweep/shared.py) and robustness.dir the
sweep's shared corrupted sets; with sharing on, evaluate reads the pretrained CNN's evaluation from the
storage's shared store (:func:`stage_options`, stages/cnn_evaluation.py). No stage logic lives here.

Resume and exactly-once:
- ``trial.json`` (and every Tune checkpoint) holds the trial's MLflow run id; a restarted trial (Tune retry,
  ``Tuner.restore``, SLURM requeue) reopens that run instead of creating another.
- ``.sweep/<stage>.json`` marks a stage as done (its returned metrics); a restarted trial skips done stages,
  and the stages resume their own partial state (runs/.partial/) exactly. A training stage that published
  its outputs before a kill took the mark with it is recorded, not trained again (shared.published). ``stages.jsonl`` gets one line per
  stage execution that completed, ``done.json`` is written last: a trial found done is not run again.
- An flock on the trial directory keeps two attempts of the same trial from running at once (an orphan of a
  killed driver finishes or dies first).

Progress: ``tune.report`` after each stage and after each fine-tuning epoch (read from the finetune stage's
resume state, which it writes at every epoch end), each with a small checkpoint holding the run id.

Where it ran: ``trial.json`` lists the node of every attempt (``nodes``; SLURM's node name, else the host),
``done.json`` the node that finished it, each ``stages.jsonl`` line its node, and the MLflow run carries
``tcnn.node`` (this attempt's) and ``tcnn.attempt_nodes``; data-parallel stages add their ranks' nodes to
``workers.jsonl`` (pipelines/ddp.py). A trial whose node was lost mid-stage resumes on another node from
the stage's own partial state (``runs/.partial/``), as after any kill.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from core.utils.locks import locked
from core.utils.machine import cpu_model
from pipelines.ddp import node_name, run_stage, worker_nodes
from pipelines.sweep import replay, reuse
from pipelines.sweep.epoch_watch import EpochWatcher, shared_progress
from pipelines.sweep.plan import trial_label, trial_params
from pipelines.sweep.replay import DONE, REFUSED, STATE
from pipelines.sweep.shared import ENSURE, append_line, link_pretraining, published, runs_log
from pipelines.sweep.trial_files import LOG, STAGE_LOG, read_json, trial_dir
from pipelines.sweep.trial_metrics import headline, last_trial_stage, numeric, progress
from pipelines.sweep.trial_tracking import (
    REFUSED_TAG,
    WORKER_NODES_TAG,
    close_run,
    logged_epochs,
    open_run,
    stopped,
    trial_artifacts,
    trial_description,
)
from pipelines.sweep.tune_report import Reporter, checkpoint_state
from stages.harness import chain
from stages.harness.catalogue import epoch_metrics, headline_summary, parent_description
from stages.harness.chain import sweep_role, trains, trial_stages
from stages.harness.runner import REFUSALS
from stages.tracking.names import NOTE_TAG

# ---------------------------------------------------------------------------------------------- trial


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Stage output (progress lines) into the trial's log file instead of the driver's terminal."""
    with open(path, "a", buffering=1) as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} attempt on {socket.gethostname()} pid {os.getpid()}")
        yield


class TrialRunner:
    def __init__(self, spec: dict[str, Any], tid: str, *, report: bool = True) -> None:
        self.spec = spec
        self.tid = tid
        self.root = trial_dir(spec, tid)
        self.params = trial_params(spec, tid)
        self.report_enabled = report
        self.marks = self.root / ".sweep"
        self.nodes: list[str] = []  # the node of every attempt, this one last
        self.current = "trial"  # the stage running now (named by a refusal)
        # its Tune config (what a record must match: pipelines.sweep.replay)
        self.config: dict[str, Any] = {"tid": tid}

    def stage(
        self,
        name: str,
        fn: Callable[[], dict[str, Any]],
        *,
        training: bool = False,
        line: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Run a stage unless its done-mark exists; returns (its metrics, whether it ran now).

        ``training``: a training stage whose published outputs count as done when a kill came between its
        publication and the mark (pipelines.sweep.shared.published); its line says ``recovered``. ``line``:
        more fields for its stages.jsonl line (filled by ``fn``: ``reused``)."""
        mark = self.marks / f"{name}.json"
        saved = read_json(mark)
        if saved is not None:
            return saved, False
        t0 = time.time()
        done = published(self.root, name) if training else None
        metrics = done if done is not None else fn()
        atomic_write_json(mark, metrics)
        append_line(
            self.root / STAGE_LOG,
            {
                "stage": name,
                "started": t0,
                "finished": time.time(),
                "host": socket.gethostname(),
                "node": node_name(),
                "cpu": cpu_model(),
                "pid": os.getpid(),
                **({"recovered": True} if done is not None else {}),
                **(line or {}),
            },
        )
        return metrics, done is None

    def run(self) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.marks.mkdir(exist_ok=True)
        # no TCNN_QUIET: the trial's log is no terminal, so training prints a progress line every 30 s into it
        # (core.training.progress) besides one line per epoch
        threads = int(self.spec.get("threads") or 1)
        import torch

        torch.set_num_threads(max(1, threads))
        with locked(self.root, f"trial {self.tid}"), _output_to(self.root / LOG):
            replayed = self._replayed()  # recorded on another machine (pipelines.sweep.replay)
            return replayed if replayed is not None else self._run()

    def _replayed(self) -> dict[str, Any] | None:
        """The trial's outcome replayed from its record (pipelines.sweep.replay): its reports to Tune in their
        order (a ``SystemExit`` when Tune stops it, as it did when recorded), its files restored; None when it
        has a local state or no matching record, or when Tune did not stop a stopped one (it then trains)."""
        if any((self.root / f).exists() for f in (DONE, REFUSED, STATE)):
            return None
        rec = replay.lookup(
            self.spec, self.tid, replay.identity(self.spec, self.tid, self.config, self.params)
        )
        if rec is None:
            return None
        replay.restore(rec, self.root)
        print(f"replay: {self.tid}: {len(rec['reports'])} report(s) recorded on {rec['recorded']['cpu']} "
              f"({rec['state']})", flush=True)  # fmt: skip
        report = Reporter(self.tid, None, self.report_enabled)
        for row in rec["reports"]:
            report(row)
        if rec["state"] == "stopped":
            print(f"replay: {self.tid}: not stopped where it was recorded; trained here", flush=True)
            replay.clear(self.root)
            return None
        return read_json(self.root / (DONE if rec["state"] == "finished" else REFUSED))

    def _run(self) -> dict[str, Any]:
        state = read_json(self.root / STATE) or {}
        refused = read_json(self.root / REFUSED)
        if refused is not None:  # a refusal is deterministic: the same params are refused again, not rerun
            return refused
        done = read_json(self.root / DONE)
        if done is not None:  # finished before (the driver died before Tune recorded it): not run again
            close_run(self.spec, done.get("mlflow_run_id"))
            Reporter(self.tid, done.get("mlflow_run_id"), self.report_enabled)(
                {"stage": "done", **done["headline"]}
            )
            return done
        known = state.get("mlflow_run_id") or checkpoint_state().get("mlflow_run_id")
        self.nodes = [*state.get("nodes", []), node_name()]
        tracker = open_run(self.spec, self.tid, self.params, self.root, known, self.nodes)
        run_id = tracker.run_id
        attempts = int(state.get("attempts", 0)) + 1
        atomic_write_json(
            self.root / STATE,
            {
                "tid": self.tid,
                "mlflow_run_id": run_id,
                "attempts": attempts,
                "nodes": self.nodes,
                "overrides": self.spec["trials"][self.tid]["overrides"],
            },
        )
        report = Reporter(self.tid, run_id, self.report_enabled)
        report({"stage": "start", "attempt": attempts})
        try:
            done = self._stages(tracker, report)
            tracker.end("FINISHED")
        except REFUSALS as err:  # no exception reaches Ray: it would retry what fails the same way
            return self._refused(err, tracker, report)
        except BaseException as err:
            tracker.end("KILLED" if stopped(err) else "FAILED")
            raise
        report({"stage": "done", **done["headline"]})
        return done

    def _stages(self, tracker: Any, report: Reporter) -> dict:
        """The stages dvc.yaml gives a trial (`stages.harness.chain.trial_stages`), in the chain's order: a shared one
        (``group``) from its shared directory, the others in the trial's directory."""
        results: dict[str, dict[str, Any]] = {}
        for name in trial_stages():
            metrics, executed = self._run_stage(name, tracker, report)
            results[name] = metrics
            report({"stage": name, "executed": executed, **progress(name, metrics)})
        for name, metrics in results.items():
            tracker.log_metrics(numeric(metrics, "" if name == last_trial_stage() else f"{name}_"))
        tracker.log_metrics(
            headline(self.root) | headline_summary(self.root)
        )  # what the DVC path logs on its parent
        t = self.spec["trials"][self.tid]
        note = parent_description(trial_description(self.tid, self.params, t["overrides"]), self.root)
        tracker.set_tags({NOTE_TAG: note})
        for path, folder in trial_artifacts(tuple(results), self.params, self.root):
            tracker.log_artifact(path, folder)
        done = {
            "tid": self.tid,
            "label": trial_label(t["overrides"]),
            "overrides": t["overrides"],
            "headline": headline(self.root),
            "pretrain_key": t["pretrain_key"] if self.spec["share_pretraining"] else None,
            "mlflow_run_id": tracker.run_id,
            "node": node_name(),
            "attempt_nodes": self.nodes,
            "worker_nodes": worker_nodes(*_stage_roots(self.root)),
            "finished": time.time(),
        }
        if done["worker_nodes"]:
            tracker.set_tags({WORKER_NODES_TAG: ",".join(done["worker_nodes"])})
        atomic_write_json(self.root / DONE, done)
        return done

    def _refused(self, err: Exception, tracker: Any, report: Reporter) -> dict[str, Any]:
        """The trial's end when a stage refused its inputs: ``refused.json`` (the stage and its one line, read by
        the summary and the driver), the MLflow run FAILED with the line as ``tcnn.refused``, one Tune report."""
        line = f"{self.current}: {' '.join(str(err).split())}"
        record = {"tid": self.tid, "refused": line, "mlflow_run_id": tracker.run_id}
        atomic_write_json(self.root / REFUSED, record)
        print(f"trial {self.tid}: refused: {line}", flush=True)  # into trial.log
        tracker.set_tags({REFUSED_TAG: line[:5000]})
        tracker.end("FAILED")
        report({"stage": "refused"})
        return record

    def _run_stage(self, name: str, tracker: Any, report: Reporter) -> tuple[dict[str, Any], bool]:
        """One stage of the trial; returns (its metrics, whether this call executed it)."""
        self.current = name
        t = self.spec["trials"][self.tid]
        key = t.get(f"{name}_key")
        if sweep_role(name) == "group" and self.spec["share_pretraining"] and key:
            with shared_progress(Path(self.spec["storage"]) / name / key, name, report):
                directory, executed, metrics = ENSURE[name](self.spec, key, trial=self.tid)
            link_pretraining(self.root, directory, name)
            if executed:
                append_line(self.root / STAGE_LOG, {"stage": name, "shared": key, "finished": time.time()})
            return metrics, executed
        fn = self._own(name)
        if sweep_role(name) == "group":  # run in the trial (sharing off): counted as the sweep's execution
            return self.stage(name, self._counted(name, fn))
        share = self.spec["share_pretraining"] and name == reuse.STAGE
        source = reuse.finished(self.spec, self.params, self.root) if share else None
        if source is not None:  # the same fine-tuning, finished by another trial in this storage
            line: dict[str, Any] = {}
            metrics, _ = self.stage(name, lambda: self._adopted(source, tracker, report, line), line=line)
            return metrics, False  # adopted, not trained: the progress line says "finetune reused"
        if trains(name):
            fn = self._watched(name, fn, tracker, report)
        out = self.stage(name, fn, training=trains(name))
        if share:
            reuse.register(self.spec, self.params, self.root, self.tid)
        return out

    def _adopted(self, source: Path, tracker: Any, report: Reporter, line: dict[str, Any]) -> dict[str, Any]:
        """``source``'s finished fine-tuning as this trial's (pipelines.sweep.reuse): its outputs copied, its
        epochs logged and reported as if trained here; its stages.jsonl line says ``reused``: ``source``."""
        metrics, history = reuse.adopt(source, self.root)
        emit = self.epoch_emitter(reuse.STAGE, tracker, report)
        for row in history:
            emit(row)
        line["reused"] = str(source)
        return metrics

    def _own(self, name: str) -> Callable[[], dict[str, Any]]:
        workers = None if trains(name) else 1  # only training stages run data parallel
        options = stage_options(self.spec, name)
        return lambda: run_stage(name, self.params, self.root, self.spec, workers=workers, options=options)

    def _counted(self, name: str, fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            recovered = published(self.root, name)  # a kill between publication and the mark
            metrics = recovered if recovered is not None else fn()
            record = {"sweep": self.spec["name"], "trial": self.tid, "host": socket.gethostname(),
                      "node": node_name(), "finished": time.time(), "recovered": recovered is not None}  # fmt: skip
            append_line(Path(self.spec["sweep_dir"]) / runs_log(name), record)
            return metrics

        return run

    def epoch_report(self, result: dict[str, Any]) -> dict[str, Any]:
        """What a trial reports to Tune for one fine-tuning epoch (a grid trial: the epoch's row as it is)."""
        return result

    def epoch_emitter(self, name: str, tracker: Any, report: Reporter) -> Callable[[dict[str, Any]], None]:
        """What a fine-tuning epoch's history row becomes: metrics on the trial's MLflow run (once per epoch,
        over attempts) and a Tune report (:meth:`epoch_report`; again on a resume)."""
        logged = logged_epochs(tracker)  # by an earlier attempt: a resumed stage's history holds them again

        def emit(row: dict[str, Any]) -> None:
            if report.halted:  # Tune stopped the trial: an epoch trained since is not the trial's (Reporter)
                raise SystemExit(0)
            m = epoch_metrics(row)  # the DVC path's per-epoch names (stages.harness.catalogue)
            epoch = int(row.get("finetune_epoch", 0))
            if (
                epoch not in logged
            ):  # also within an attempt: a report that raised leaves the row to be seen again
                tracker.log_metrics(m, step=epoch)
                logged.add(epoch)
            # Reported to Tune again on a resume: a scheduler records one result per trial and rung, and one
            # that an earlier attempt logged but did not report must still reach it.
            keys = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
            values = {k: m[f"epoch/{k}"] for k in keys if f"epoch/{k}" in m}
            report(self.epoch_report({"stage": name, "finetune_epoch": epoch, **values}))

        return emit

    def _watched(
        self, name: str, fn: Callable[[], dict[str, Any]], tracker: Any, report: Reporter
    ) -> Callable[[], dict[str, Any]]:
        """A trial's own training stage, its epochs logged and reported as they finish (read from the resume
        state the stage rewrites at every epoch end)."""
        emit = self.epoch_emitter(name, tracker, report)

        def run() -> dict[str, Any]:
            watcher = EpochWatcher(self.root / chain.partial_dir(name) / "resume.pt", emit)
            watcher.start()
            try:
                metrics = fn()
            finally:
                watcher.stop()
            history = read_json(self.root / chain.output(name, "history.json"))
            watcher.rows(history if isinstance(history, list) else [])  # epochs finished after the last poll
            return metrics

        return run


def stage_options(spec: dict[str, Any], stage: str) -> dict[str, Any]:
    """What a trial's own stage is given besides its params and directory: with sharing on, evaluate reads
    (or makes) the pretrained CNN's evaluation in the sweep storage's shared store (stages.cnn_evaluation)."""
    if stage != "evaluate" or not spec["share_pretraining"]:
        return {}
    from stages.cnn_evaluation import DIR

    return {"shared": str(Path(spec["storage"]) / DIR)}


def _stage_roots(root: Path) -> list[Path]:
    """Where the trial's stages ran: its directory and the shared pretraining/control it links to."""
    links = [root / chain.run_dir(stage) for stage in trial_stages() if sweep_role(stage) == "group"]
    return [root, *(link.resolve().parents[1] for link in links if link.is_symlink())]


def tune_trainable(config: dict[str, Any], spec: dict[str, Any]) -> None:
    """The Ray Tune function trainable (config: {"tid": ...}); ``spec``: the sweep plan (tune.with_parameters)."""
    runner = TrialRunner(spec, config["tid"])
    runner.config = dict(config)
    runner.run()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
