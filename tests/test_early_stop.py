"""finetune.stop: early stopping on validation accuracy (core.training.early_stop), in fit and in both arms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_helpers import TEST_DEVICE, tiny_params, write_dataset
from test_train_fit import Tiny, _assert_same_state, _loaders, _stop_at, _strip

from core.config import StopConfig, validate_params
from core.training import early_stop as ES
from core.training import loop
from core.training.checkpoint import load
from core.training.loop import fit
from core.training.model_eval import TrainLoss
from core.training.optim import WarmupCosine, build_sgd
from core.training.resume_file import RESUME_FILE
from core.training.stop_signals import Preempted

RULE = StopConfig(patience=2, min_delta_images=2)
# validation correct counts per epoch label 1..6 (12 validation images): rise at 2 (+3), 3 is +1 (below the
# threshold, but the best: its weights are kept), 4 and 5 do not beat the rise at 2 by 2 -> stop after epoch 4
SCRIPT = {1: 5, 2: 8, 3: 9, 4: 7, 5: 12, 6: 12}
MAX_EPOCHS = 6


@pytest.mark.parametrize(
    "counts,patience,delta,expected",
    [
        ([5, 8, 9, 7, 12, 12], 2, 2, (4, 3)),  # the kept epoch (3) is not the last rise (2)
        ([5, 6, 7, 8, 9], 1, 1, (5, 5)),  # rising each epoch: runs to the end
        ([5, 6, 7, 8, 9], 1, 2, (2, 2)),  # +1 is not a rise of 2: stops after epoch 2, keeps epoch 2
        ([5, 5, 5, 5], 3, 0, (4, 1)),  # 0 counts as 1: a flat curve stops; the earliest of a tie is kept
        ([9, 3, 4, 5, 6, 7], 3, 1, (4, 1)),  # below the first epoch: no rise
        ([3], 1, 10, (1, 1)),
    ],
)
def test_rule_on_hand_sequences(counts, patience, delta, expected) -> None:
    assert ES.stop_epoch(counts, patience=patience, min_delta_images=delta) == expected


def _scripted_evaluate(monkeypatch: pytest.MonkeyPatch, script: dict[int, int] | None = SCRIPT):
    """fit's validation returns the scripted count for the epoch the last step trained (so a resume replays it)."""
    seen = {"label": 0}
    real = loop.evaluate

    def fake(model, batches, **kw):
        out = real(model, batches, **kw)
        return out if script is None else {**out, "acc": script[seen["label"]] / out["n"]}

    def on_step(info) -> None:
        seen["label"] = info.epoch + 1

    monkeypatch.setattr(loop, "evaluate", fake)
    return on_step


def _run(work: Path, rule: StopConfig | None, on_step, *, init_seed: int = 0):
    torch.manual_seed(init_seed)
    model = Tiny()
    torch.manual_seed(123)
    opt = build_sgd(model, lr=0.2, momentum=0.9, weight_decay=1e-3)
    train, val = _loaders()
    sched = WarmupCosine(opt, total_steps=MAX_EPOCHS * len(train), warmup_steps=3)
    res = fit(
        model, opt, sched, train, epochs=range(MAX_EPOCHS), work_dir=work, run_hash="h", loss_fn=TrainLoss(0.1),
        val_loader=val, checkpoint_every_steps=4, epoch_checkpoints=range(MAX_EPOCHS + 1), on_step=on_step,
        early_stop=rule, log=lambda m: None,
    )  # fmt: skip
    return model, res


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch):
    return _scripted_evaluate(monkeypatch)


def test_fit_stops_and_keeps_the_best_epoch(tmp_path: Path, scripted) -> None:
    model, res = _run(tmp_path, RULE, scripted)
    assert [r["epoch"] for r in res.history] == [1, 2, 3, 4]
    assert res.early_stop["stopped"] and res.early_stop["best_epoch"] == 3
    assert sorted(res.epoch_checkpoints) == [0, 1, 2, 3, 4]
    best = load(res.epoch_checkpoints[3])["model"]
    assert all(torch.equal(model.state_dict()[k], best[k]) for k in best)
    assert ES.reason(res.early_stop, patience=2, min_delta_images=2) == (
        "val accuracy did not rise by >= 2 images for 2 epochs"
    )


def test_rule_that_never_fires_is_todays_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rising every epoch (the best is the last): the same weights and history as a run without the rule;
    without it, fit's checkpoint holds no early-stopping state."""
    on_step = _scripted_evaluate(monkeypatch, {e: e for e in range(1, MAX_EPOCHS + 1)})
    off_model, off = _run(tmp_path / "off", None, on_step)
    on_model, on = _run(tmp_path / "on", StopConfig(patience=1, min_delta_images=1), on_step)
    assert off.early_stop is None and "early_stop" not in load(tmp_path / "off" / RESUME_FILE)
    assert on.early_stop == {
        "best_correct": 6,
        "best_epoch": 6,
        "ref_correct": 6,
        "since": 0,
        "stopped": False,
    }
    _assert_same_state(on_model, off_model)
    assert _strip(on.history) == _strip(off.history)


# 7 steps per epoch: stops mid-epoch 2 (before the best), at the end of the best epoch (3), mid-epoch 4
@pytest.mark.parametrize("stop_step", [10, 21, 25])
def test_resumed_run_stops_at_the_same_epoch_with_the_same_weights(
    tmp_path: Path, scripted, stop_step
) -> None:
    ref_model, ref = _run(tmp_path / "ref", RULE, scripted)
    with pytest.raises(Preempted):
        _run(tmp_path / "run", RULE, _compose(scripted, _stop_at(stop_step)))
    model, res = _run(tmp_path / "run", RULE, scripted, init_seed=999)
    assert res.resumed_from is not None
    assert res.early_stop == ref.early_stop
    assert _strip(res.history) == _strip(ref.history)
    _assert_same_state(model, ref_model)
    again_model, again = _run(tmp_path / "run", RULE, scripted, init_seed=7)  # a stopped run stays stopped
    assert again.global_step == ref.global_step
    _assert_same_state(again_model, ref_model)


def _compose(*fns):
    def on_step(info) -> None:
        for f in fns:
            f(info)

    return on_step


def test_identity_leaves_an_absent_stop_out() -> None:
    from stages import finetune

    base = tiny_params(Path("d"))
    off = finetune.identity(validate_params(base), {"checkpoint": "x"}, "cpu")
    assert "stop" not in off and "stop" not in off["finetune"]
    base["finetune"]["stop"] = {"patience": 3, "min_delta_images": 10}
    on = finetune.identity(validate_params(base), {"checkpoint": "x"}, "cpu")
    assert on["stop"] == {"patience": 3, "min_delta_images": 10}
    assert {k: v for k, v in on.items() if k != "stop"} == off


@pytest.mark.slow
def test_both_arms_record_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The T-CNN and its control stop by the same rule, each on its own validation curve, and say so."""
    from stages import control, finetune, pretrain, reparam
    from stages.harness.catalogue import stage_metrics

    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)
    data = write_dataset(tmp_path / "data", n_train=200, n_test=100)
    raw = tiny_params(data, pretrain={"epochs": 1}, finetune={"epochs": 4, "stop": {"patience": 1}})
    params = validate_params(raw)
    pretrain.run(params, root=tmp_path)
    reparam.run(params, root=tmp_path)
    curves = iter([[50, 70, 65, 80], [50, 60, 70, 81]])  # counts of 100 validation images per epoch

    def scripted(model, batches, **kw):
        out = real(model, batches, **kw)
        return {**out, "acc": curve.pop(0) / out["n"]}

    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", scripted)
    curve = next(curves)
    m_t = finetune.run(params, root=tmp_path)
    curve = next(curves)
    m_c = control.run(params, root=tmp_path)
    assert (m_t["stopped_epoch"], m_t["best_epoch"], m_t["epochs_run"]) == (3, 2, 3)
    assert m_t["best_val_accuracy"] == m_t["val_acc"] == 0.70
    assert m_t["stop_reason"] == "val accuracy did not rise by >= 10 images for 1 epochs"
    assert (m_c["stopped_epoch"], m_c["best_epoch"], m_c["best_val_accuracy"]) == (4, 4, 0.81)
    assert m_c["stop_reason"] == "reached finetune.epochs"
    logged = stage_metrics("control", m_c)  # MLflow: the numbers, as epochs_run
    assert {"stopped_epoch", "best_epoch", "best_val_accuracy"} <= logged.keys()
