"""The sweep driver's progress lines: one concise line per trial event, for a grid (:class:`SweepProgress`) and a
search (:class:`SearchProgress`). Ray Tune's own table is off for a grid; a search shows it too when stdout is
a terminal (pipelines/sweep/tuner.py)."""

from __future__ import annotations

from typing import Any

from ray import tune


def _f(result: dict, key: str) -> float:
    value = result.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


class SweepProgress(tune.Callback):
    """``[finished/total] <tid> <grid values>: <event>`` for start, pretraining, reparam, each fine-tuning
    epoch, done and errors. Module-level so that Tune can pickle it with the experiment (restore)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = dict(labels)

    def _say(self, trials: list, tid: str, text: str) -> None:
        done = sum(1 for t in trials if t.status == "TERMINATED")
        print(f"[{done}/{len(self.labels)}] {tid} {self.labels.get(tid, '')}: {text}", flush=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        stage, tid = result.get("stage"), trial.config.get("tid")
        if stage == "start":
            text = f"started (attempt {result.get('attempt')})"
        elif "finetune_epoch" in result:
            text = f"{stage} epoch {result.get('finetune_epoch')} val_acc {_f(result, 'val_acc'):.4f}"
        elif stage == "pretrain":
            text = "pretrained" if result.get("executed") else "pretraining reused"
        elif f"{stage}_max_abs_logit_diff" in result:
            text = f"reparameterized (max |logit diff| {_f(result, f'{stage}_max_abs_logit_diff'):.2e})"
        elif f"{stage}_test_acc" in result:
            text = f"{stage} {'trained' if result.get('executed') else 'reused'} (test acc {_f(result, f'{stage}_test_acc'):.4f})"
        elif stage == "done":
            d = "tcnn_minus_control_clean_accuracy"
            vs = (
                f" T-CNN-control {100 * _f(result, d):+.2f} pp [{100 * _f(result, d + '_ci_low'):+.2f}, "
                f"{100 * _f(result, d + '_ci_high'):+.2f}]"
                if d in result
                else ""
            )
            text = (
                f"done: CNN {_f(result, 'cnn_clean_accuracy'):.4f} T-CNN {_f(result, 'tcnn_clean_accuracy'):.4f}"
                f"{vs} mCA {_f(result, 'tcnn_mca'):.4f} mCE {_f(result, 'tcnn_mce'):.3f}"
            )
        else:
            text = f"{stage} done"
        self._say(trials, tid, text)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trials, trial.config.get("tid"), f"error (see {trial.path}/error.txt)")


class SearchProgress(tune.Callback):
    """A search's (``sweep.search``) line per trial event: ``[ended/total] p001-tcnn finetune.lr=0.0123: <event>`` for
    started, each epoch of the shared pretraining (once, whichever trial reports it), each fine-tuning epoch
    with its validation accuracy, stopped by the scheduler at its rung (the last epoch it reported), finished
    (every epoch trained) and errors. Module-level so that Tune can pickle it with the experiment (restore)."""

    def __init__(self, total: int) -> None:
        self.total = int(total)
        self.pretrain_seen: set[int] = set()

    def _say(self, trials: list, trial: Any, text: str) -> None:
        from pipelines.sweep.arm_trial import arm_tid, point_values
        from pipelines.sweep.plan import trial_label
        from pipelines.sweep.scheduling import ARM_KEY
        from pipelines.sweep.search import POINT_KEY

        ended = sum(1 for t in trials if t.status in ("TERMINATED", "ERROR"))
        config = trial.config or {}
        tid = arm_tid(config[POINT_KEY], config[ARM_KEY]) if POINT_KEY in config else str(trial)
        print(f"[{ended}/{self.total}] {tid} {trial_label(point_values(config))}: {text}", flush=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        stage = result.get("stage")
        if stage == "start":
            self._say(trials, trial, f"started (attempt {result.get('attempt')})")
        elif "finetune_epoch" in result and "val_acc" not in result:  # the last epoch, reported without
            # the metric (ArmTrial.epoch_report: the scheduler must not end the trial before its done.json)
            self._say(trials, trial, f"{stage} epoch {result['finetune_epoch']} (the last: its val_acc on the "
                                     "finished line)")  # fmt: skip
        elif "finetune_epoch" in result:
            self._say(
                trials, trial, f"{stage} epoch {result['finetune_epoch']} val_acc {_f(result, 'val_acc'):.4f}"
            )
        elif (
            isinstance(result.get("pretrain_epoch"), int)
            and result["pretrain_epoch"] not in self.pretrain_seen
        ):
            self.pretrain_seen.add(result["pretrain_epoch"])
            self._say(trials, trial, f"shared pretraining epoch {result['pretrain_epoch']} "
                                     f"val_acc {_f(result, 'pretrain_val_acc'):.4f}")  # fmt: skip
        elif stage == "refused":
            self._say(trials, trial, "refused (see its trial.log)")

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        from pipelines.sweep.scheduling import METRIC, TIME_ATTR

        last = trial.last_result or {}
        if last.get("stage") == "done":
            text = f"finished: {last.get(TIME_ATTR)} epochs, val_acc {_f(last, METRIC):.4f}"
        elif last.get("stage") == "refused":
            return
        else:
            text = f"stopped by the scheduler at epoch {last.get(TIME_ATTR, last.get('finetune_epoch'))} (its rung)"
        self._say(trials, trial, text)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trials, trial, f"error (see {trial.path}/error.txt)")
