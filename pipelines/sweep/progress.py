"""The sweep driver's progress lines: one concise line per trial event (Ray Tune's own table is off)."""

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
