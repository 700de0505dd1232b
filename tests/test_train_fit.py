"""core.training.loop.fit in-process: exact resume after a stop at any step, stop signals, hash checks, NaN guard."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from core.config import AugmentConfig
from core.data import BatchLoader
from core.training.checkpoint import load
from core.training.loop import TIMING_KEYS, TrainingError, fit
from core.training.model_eval import TrainLoss
from core.training.optim import WarmupCosine, build_sgd
from core.training.resume_file import RESUME_FILE
from core.training.stop_signals import Preempted

EPOCHS = 3


@pytest.fixture(autouse=True)
def _default_stop_handlers():
    """These tests chain to the handler found before the loop's own (StopSignals.chain): each starts with the
    defaults, whatever an earlier test of the same xdist worker left (ray.init's SIGTERM handler exits)."""
    from core.training.stop_signals import STOP_SIGNALS

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class Tiny(nn.Module):
    """Conv + BN + dropout (uses the torch RNG, so a resume must restore it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2)
        )
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.body(x).flatten(1)))


def _loaders(mix: bool = False) -> tuple[BatchLoader, BatchLoader]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(72, 12, 12, 1), dtype=np.uint8)
    y = rng.integers(0, 4, size=72)
    aug = AugmentConfig(crop_padding=2, hflip=True, mixup=0.4 if mix else 0.0, label_smoothing=0.1)
    kw = {"seed": 5, "mean": [0.5], "std": [0.25], "num_classes": 4}
    return (
        BatchLoader(x[:60], y[:60], batch_size=8, train=True, augment=aug, **kw),
        BatchLoader(x[60:], y[60:], batch_size=16, train=False, **kw),
    )


def _run(
    work: Path, *, init_seed: int = 0, on_step=None, run_hash: str = "h", every: int = 2, mix: bool = False
):
    torch.manual_seed(init_seed)
    model = Tiny()
    torch.manual_seed(123)  # the RNG stream training starts from (a resume restores its own)
    opt = build_sgd(model, lr=0.2, momentum=0.9, weight_decay=1e-3)
    train, val = _loaders(mix)
    sched = WarmupCosine(opt, total_steps=EPOCHS * len(train), warmup_steps=3)
    res = fit(
        model, opt, sched, train, epochs=range(EPOCHS), work_dir=work, run_hash=run_hash,
        loss_fn=TrainLoss(0.1), val_loader=val, checkpoint_every_steps=every, epoch_checkpoints=(0, 2),
        on_step=on_step, log=lambda m: None,
    )  # fmt: skip
    return model, opt, res


def _stop_at(global_step: int, signum: int = signal.SIGTERM):
    def on_step(info) -> None:
        if info.global_step == global_step:
            info.stop.received = signum

    return on_step


def _strip(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in history]


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    return _run(tmp_path_factory.mktemp("ref"))


# 7 steps per epoch: stops mid-epoch (3; 12, where a cadence checkpoint is due too) and on an epoch's last step (7)
@pytest.mark.parametrize("stop_step", [3, 7, 12])
def test_resume_after_stop_is_bitwise_equal(tmp_path: Path, reference, stop_step: int) -> None:
    ref_model, ref_opt, ref_res = reference
    with pytest.raises(Preempted) as stop:
        _run(tmp_path, on_step=_stop_at(stop_step))
    spe = len(_loaders()[0])
    assert (stop.value.epoch * spe + stop.value.step) == stop_step
    state = load(tmp_path / RESUME_FILE)
    assert state["global_step"] == stop_step
    model, opt, res = _run(
        tmp_path, init_seed=999
    )  # a different init: everything must come from the checkpoint
    assert res.resumed_from == (stop_step // spe, stop_step % spe)
    _assert_same_state(model, ref_model)
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(ref_opt.state[p_ref]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    assert _strip(res.history) == _strip(ref_res.history)
    assert sorted(res.epoch_checkpoints) == sorted(ref_res.epoch_checkpoints) == [0, 2]
    for label, path in res.epoch_checkpoints.items():
        a, b = load(path), load(ref_res.epoch_checkpoints[label])
        assert a["epoch"] == b["epoch"] == label
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_resume_with_mixup_soft_targets(tmp_path: Path) -> None:
    ref_model, _, ref_res = _run(tmp_path / "ref", mix=True)
    with pytest.raises(Preempted):
        _run(tmp_path / "run", on_step=_stop_at(9), mix=True)
    model, _, res = _run(tmp_path / "run", mix=True)
    _assert_same_state(model, ref_model)
    assert _strip(res.history) == _strip(ref_res.history)


def test_uninterrupted_run_differs_from_a_shifted_one(tmp_path: Path, reference) -> None:
    """Guard against a vacuous comparison: another init seed gives other weights."""
    model, _, _ = _run(tmp_path, init_seed=1)
    assert not torch.equal(model.fc.weight, reference[0].fc.weight)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_real_signal_checkpoints_then_chains_the_previous_handler(tmp_path: Path, signum: int) -> None:
    seen: list[bool] = []

    def previous(sig, frame) -> None:  # e.g. submitit's requeue handler: the checkpoint must exist by now
        seen.append((tmp_path / RESUME_FILE).exists())

    old = signal.signal(signum, previous)
    try:

        def on_step(info) -> None:
            if info.global_step == 4:
                os.kill(os.getpid(), signum)

        with pytest.raises(Preempted) as stop:
            _run(tmp_path, on_step=on_step)
        assert signal.getsignal(signum) is previous  # our handler is gone again
    finally:
        signal.signal(signum, old)
    assert stop.value.signum == signum and seen == [True]
    assert load(tmp_path / RESUME_FILE)["global_step"] == 4


def test_other_params_start_fresh_and_say_so(tmp_path: Path) -> None:
    with pytest.raises(Preempted):
        _run(tmp_path, on_step=_stop_at(5))
    _, _, res = _run(tmp_path, run_hash="other")
    assert res.resumed_from is None
    assert any("starting fresh" in n for n in res.notes)


def test_unreadable_resume_file_starts_fresh(tmp_path: Path, reference) -> None:
    with pytest.raises(Preempted):
        _run(tmp_path, on_step=_stop_at(5))
    (tmp_path / RESUME_FILE).write_bytes(b"garbage")
    model, _, res = _run(tmp_path)
    assert res.resumed_from is None and any("unreadable" in n for n in res.notes)
    _assert_same_state(model, reference[0])


def test_nan_loss_stops_training(tmp_path: Path) -> None:
    class NanLoss(nn.Module):
        def forward(self, logits, target):
            return logits.sum() * float("nan")

    model = Tiny()
    opt = build_sgd(model, lr=0.1, momentum=0.9, weight_decay=0.0)
    train, _ = _loaders()
    sched = WarmupCosine(opt, total_steps=len(train))
    with pytest.raises(TrainingError, match="loss became nan in epoch 1"):
        fit(model, opt, sched, train, epochs=range(1), work_dir=tmp_path, run_hash="h", loss_fn=NanLoss(),
            log=lambda m: None)  # fmt: skip
