"""One trial of a search (``sweep.search``): one arm at one point (pipelines/sweep/search.py).

Tune's config is the point's values plus ``point`` (its index) and ``arm``: ``tcnn`` runs reparam -> finetune,
``control`` runs the matched control (the same CNN checkpoint fine-tuned with the same recipe, without attention:
T-CNN, d'Ascoli et al. 2021, Table 1's "without SA"), both from the search's one shared pretraining
(``<storage>/pretrain/<key>``, pipelines/sweep/shared.py) and with the DVC path's stage functions. Its directory is
``<sweep>/trials/p<point>-<arm>/``.

Every fine-tuning epoch is logged on the trial's MLflow run and reported to Tune (``epoch``, ``val_acc``, the
losses, the lr: :meth:`TrialRunner._watched`), so a scheduler can stop the trial (pipelines/sweep/scheduling.py).
A stopped trial's process is ended by Ray; its run is closed by the driver (search_summary.close_stopped). A
trial that trained every epoch writes ``done.json`` (its history and last validation accuracy). Resume is the
grid trial's: done marks per stage, the stages' own partial state, the run id in trial.json and in every Tune
checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from pipelines.ddp import node_name
from pipelines.sweep import reuse
from pipelines.sweep.epoch_watch import EpochWatcher, shared_progress
from pipelines.sweep.plan import control_identity, plan_device, trial_label, trial_params
from pipelines.sweep.replay import DONE, REFUSED, STATE
from pipelines.sweep.scheduling import ARM_KEY, METRIC, TIME_ATTR
from pipelines.sweep.search import POINT_KEY
from pipelines.sweep.shared import COMPLETE, ENSURE, link_pretraining, train_control
from pipelines.sweep.sweep_params import SweepParams, validate_sweep_params
from pipelines.sweep.trial import TrialRunner
from pipelines.sweep.trial_files import read_json, trial_dir
from pipelines.sweep.trial_tracking import close_run, stopped
from pipelines.sweep.tune_report import Reporter, checkpoint_state
from stages.harness import chain
from stages.harness.identity import key as identity_key
from stages.harness.runner import REFUSALS
from stages.tracking.names import NOTE_TAG

#: The stages of each arm after the shared pretraining (the DVC path's functions).
ARM_STAGES = {"tcnn": ("reparam", "finetune"), "control": ("control",)}
ARM_TAG, POINT_TAG = "tcnn.arm", "tcnn.point"


def arm_tid(point: int, arm: str) -> str:
    return f"p{int(point):03d}-{arm}"


def point_values(config: dict[str, Any]) -> dict[str, Any]:
    """The searched keys' values of a trial's Tune config (without ``point`` and ``arm``)."""
    return {k: v for k, v in config.items() if k not in (POINT_KEY, ARM_KEY)}


def base_tid(spec: dict[str, Any]) -> str:
    """The search's base trial in the plan: its params, pretraining key and corrupted sets."""
    (tid,) = spec["trials"]
    return tid


def arm_params(spec: dict[str, Any], values: dict[str, Any]) -> SweepParams:
    return validate_sweep_params(spec["trials"][base_tid(spec)]["params"]).with_overrides(values)


def config_params(spec: dict[str, Any], tid: str, config: dict[str, Any]) -> SweepParams:
    """The params of a trial from its Tune config: a search's arm trial (its point's values) or a grid trial."""
    return arm_params(spec, point_values(config)) if POINT_KEY in config else trial_params(spec, tid)


def control_key(spec: dict[str, Any], params: SweepParams) -> tuple[str, dict[str, Any]]:
    """A search point's matched control: the key and identity a grid's trial with these params would share
    (pipelines.sweep.plan.control_identity, on the search's pretraining): points that differ only in
    ``reparam.*`` keys, later searches and grids in the same storage find it in ``<storage>/control/<key>``."""
    identity = control_identity(params, spec["trials"][base_tid(spec)]["pretrain_key"], plan_device(params))
    return identity_key(identity), identity


def shared_epochs(directory: Path) -> int:
    """The last fine-tuning epoch a shared control directory holds now (its ``finetune_epoch``, as trials report
    it): its history's when finished, else its stage's resume state's (a holder stopped mid-training), else 0."""
    rows: Any = None
    if (directory / COMPLETE).is_file():
        rows = read_json(directory / chain.output("control", "history.json"))
    elif (directory / chain.partial_dir("control") / "resume.pt").is_file():
        import torch

        try:
            state = torch.load(directory / chain.partial_dir("control") / "resume.pt", map_location="cpu",
                               weights_only=False)  # fmt: skip
            rows = state.get("history")
        except (
            Exception
        ):  # replaced while read: counted as none (the compute line then counts them as trained)
            rows = None
    return int(rows[-1].get("finetune_epoch", 0)) if isinstance(rows, list) and rows else 0


class ArmTrial(TrialRunner):
    def __init__(self, spec: dict[str, Any], config: dict[str, Any], *, report: bool = True) -> None:
        self.point, self.arm = int(config[POINT_KEY]), str(config[ARM_KEY])
        self.values = point_values(config)
        self.spec = spec
        self.tid = arm_tid(self.point, self.arm)
        self.root = trial_dir(spec, self.tid)
        self.params = arm_params(spec, self.values)
        self.report_enabled = report
        self.marks = self.root / ".sweep"
        self.nodes: list[str] = []
        self.current = "trial"
        self.config = dict(config)

    def epoch_report(self, result: dict[str, Any]) -> dict[str, Any]:
        """An epoch's row with the scheduler's time attribute (``epoch``) and :data:`METRIC`; the last epoch's
        without them, as it is reported once the trial's outputs and done.json are written (:func:`_final`): a
        scheduler's decision at the last epoch (ASHA stops a trial at max_t) must not end it before."""
        epoch = int(result["finetune_epoch"])
        if epoch >= self.params.finetune.epochs:
            return {k: v for k, v in result.items() if k != METRIC}
        return {**result, TIME_ATTR: epoch}

    def _run(self) -> dict[str, Any]:
        refused = read_json(self.root / REFUSED)
        if refused is not None:
            return refused
        done = read_json(self.root / DONE)
        if done is not None:  # finished before: reported again, not run again
            close_run(self.spec, done.get("mlflow_run_id"))
            Reporter(self.tid, done.get("mlflow_run_id"), self.report_enabled)(_final(done))
            return done
        state = read_json(self.root / STATE) or {}
        known = state.get("mlflow_run_id") or checkpoint_state().get("mlflow_run_id")
        self.nodes = [*state.get("nodes", []), node_name()]
        tracker = self._open(known)
        attempts = int(state.get("attempts", 0)) + 1
        atomic_write_json(self.root / STATE, {**state, "tid": self.tid, "mlflow_run_id": tracker.run_id,
                                              "attempts": attempts, "nodes": self.nodes, "point": self.point,
                                              "arm": self.arm, "values": self.values})  # fmt: skip
        report = Reporter(self.tid, tracker.run_id, self.report_enabled)
        report({"stage": "start", "attempt": attempts})
        try:
            done = self._arm(tracker, report)
            tracker.end("FINISHED")
        except REFUSALS as err:
            return self._refused(err, tracker, report)
        except BaseException as err:
            tracker.end("KILLED" if stopped(err) else "FAILED")
            raise
        report(_final(done))
        return done

    def _open(self, known: str | None) -> Any:
        from stages.tracking.tracker import Tracker, TrackingError

        cfg = self.spec["tracking"]
        tracker = Tracker(enabled=cfg["enabled"], uri=cfg["uri"], experiment=cfg["experiment"])
        if not tracker.enabled:
            return tracker
        tracker.parent_run_id = cfg["parent_run_id"]
        label = trial_label(self.values)
        tags = {"tcnn.kind": "trial", "tcnn.sweep": self.spec["name"], "tcnn.trial": self.tid,
                "tcnn.trial_dir": str(self.root), ARM_TAG: self.arm, POINT_TAG: str(self.point),
                **{f"search.{k}": repr(v) for k, v in self.values.items()},
                NOTE_TAG: f"search trial {self.tid} · {self.arm} arm · point {self.point}: {label}"}  # fmt: skip
        if known:
            try:
                tracker.start_child(self.tid, params=self.params, tags=tags, run_id=known)
                return tracker
            except TrackingError:
                pass
        tracker.start_child(self.tid, params=self.params, tags=tags, run_name=self.tid)
        return tracker

    def _arm(self, tracker: Any, report: Reporter) -> dict[str, Any]:
        """The shared pretraining, then the arm's own stages; the last one's epochs watched and reported."""
        self.current = "pretrain"
        key = self.spec["trials"][base_tid(self.spec)]["pretrain_key"]
        with shared_progress(Path(self.spec["storage"]) / "pretrain" / key, "pretrain", report):
            directory, _, _ = ENSURE["pretrain"](self.spec, key, trial=self.tid)
        link_pretraining(self.root, directory, "pretrain")
        metrics: dict[str, Any] = {}
        for name in ARM_STAGES[self.arm]:
            self.current = name
            if name == "control" and self.spec["share_pretraining"]:  # shared by identity, not in the trial
                metrics, _ = self.stage(name, lambda: self._shared_control(tracker, report))
                continue
            fn = self._own(name)
            if chain.trains(name):
                fn = self._watched(name, fn, tracker, report)
            metrics, _ = self.stage(name, fn, training=chain.trains(name))
            if name == reuse.STAGE and self.spec["share_pretraining"]:  # for a grid at these values to find
                reuse.register(self.spec, self.params, self.root, self.tid)
        history = read_json(self.root / chain.output(ARM_STAGES[self.arm][-1], "history.json"))
        rows = history if isinstance(history, list) else []
        last = rows[-1] if rows else {}
        done = {"tid": self.tid, "point": self.point, "arm": self.arm, "values": self.values,
                "epoch": int(last.get("finetune_epoch", 0)), "val_acc": last.get("val_acc"),
                "test_acc": metrics.get("test_acc"), "history": rows, "mlflow_run_id": tracker.run_id,
                "node": node_name(), "finished": time.time(),
                "control_key": (read_json(self.root / STATE) or {}).get("control_key")}  # fmt: skip
        tracker.log_metrics({"final_val_acc": float(done["val_acc"])} if done["val_acc"] is not None else {})
        atomic_write_json(self.root / DONE, done)
        return done

    def _shared_control(self, tracker: Any, report: Reporter) -> dict[str, Any]:
        """The control arm's fine-tuning in the shared ``<storage>/control/<key>`` of its identity
        (:func:`control_key`), under that directory's lock (pipelines.sweep.shared.train_control), linked from
        the trial's ``runs/control``. Its epochs are watched in the shared directory, whoever trains them: a
        control finished before (another point, an earlier search or grid) reports its recorded epochs at once,
        one trial waiting for another's training reports each epoch as it ends, and a holder stopped by the
        scheduler leaves the stage's partial state, which the next trial that needs the control resumes
        exactly (the rule: a shared control trains while any trial that needs it runs; a stop ends only the
        stopped trial). trial.json keeps the key and the epochs the directory held at the trial's first start
        (``control_epochs_before``: what the search's compute line does not count as trained by it)."""
        key, identity = control_key(self.spec, self.params)
        directory = Path(self.spec["storage"]) / "control" / key
        state = read_json(self.root / STATE) or {}
        if state.get("control_key") != key:
            atomic_write_json(self.root / STATE, {**state, "control_key": key,
                                                  "control_epochs_before": shared_epochs(directory)})  # fmt: skip
        pretrain_key = self.spec["trials"][base_tid(self.spec)]["pretrain_key"]
        emit = self.epoch_emitter("control", tracker, report)
        watcher = EpochWatcher(directory / chain.partial_dir("control") / "resume.pt", emit)
        watcher.start()
        try:
            directory, _, metrics = train_control(self.spec, key, self.params, pretrain_key, identity,
                                                  trial=self.tid, users=f"search point {self.point}")  # fmt: skip
        finally:
            watcher.stop()
        history = read_json(directory / chain.output("control", "history.json"))
        watcher.rows(history if isinstance(history, list) else [])  # a finished control's, or the last ones
        link_pretraining(self.root, directory, "control")
        return metrics


def _final(done: dict[str, Any]) -> dict[str, Any]:
    """The last report of a finished arm trial: its last epoch and validation accuracy."""
    return {"stage": "done", TIME_ATTR: done["epoch"], METRIC: done["val_acc"]}


def search_trainable(config: dict[str, Any], spec: dict[str, Any]) -> None:
    """The Ray Tune function trainable of a search (config: the point's values, ``point`` and ``arm``)."""
    ArmTrial(spec, config).run()
