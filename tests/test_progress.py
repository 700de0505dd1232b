"""Progress where there is no terminal (core.training.progress): a plain line at a steady pace with epoch, step,
images/s, the ETA and the last validation accuracy; tqdm's bar on a terminal; nothing under TCNN_QUIET."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from core.data import BatchLoader
from core.training import progress as P
from core.training.loop import fit
from core.training.model_eval import TrainLoss
from core.training.optim import WarmupCosine, build_sgd


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_follows_the_terminal_and_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TCNN_QUIET", "CI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a pipe, a file, a SLURM log
    assert P.mode() == "lines"
    monkeypatch.setattr("sys.stderr", _Tty())
    assert P.mode() == "bar"
    monkeypatch.setenv("CI", "true")  # a CI log is no terminal to redraw
    assert P.mode() == "lines"
    monkeypatch.setenv("TCNN_QUIET", "1")
    assert P.mode() == "off"
    monkeypatch.setenv(P.EVERY_S_ENV, "nonsense")
    assert P.every_s() == P.DEFAULT_EVERY_S
    monkeypatch.setenv(P.EVERY_S_ENV, "5")
    assert P.every_s() == 5.0


def test_lines_come_at_their_pace_with_a_hand_computed_eta() -> None:
    now = [100.0]
    lines: list[str] = []
    bar = P.LineProgress("finetune", 1, 4, 100, 20, lines.append, last_val_acc=0.8712, every=30.0,
                         clock=lambda: now[0])  # fmt: skip
    for _ in range(10):  # 10 steps in 20 s: no line yet
        now[0] += 2.0
        bar.update(1)
    assert lines == []
    bar.set_postfix(loss="0.412", img_s="1830", refresh=False)
    for _ in range(5):  # 30 s after the start: one line
        now[0] += 2.0
        bar.update(1)
    assert len(lines) == 1
    # 15 steps in 30 s = 2 s a step; left: the rest of epoch 2 (100 - 35 = 65) and 2 more epochs (200): 530 s
    assert lines[0] == (
        "finetune: epoch 2/4 step 35/100 (35%) | loss 0.412 | 1830 img/s | ETA 0:08:50 | val_acc 0.8712"
    )
    for _ in range(14):  # 28 s more: still one line
        now[0] += 2.0
        bar.update(1)
    assert len(lines) == 1
    now[0] += 2.0
    bar.update(1)
    assert len(lines) == 2 and " step 50/100 (50%) " in lines[1]
    assert P.hms(3725) == "1:02:05" and P.hms(-1) == "0:00:00"


def test_fit_prints_lines_when_stderr_is_no_terminal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The training loop's own use: under a pipe (and every 0 s), a line per step with the epoch's step count and
    from the second epoch the first epoch's validation accuracy; TCNN_QUIET=1 leaves only the epoch lines."""
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.delenv("TCNN_QUIET", raising=False)
    monkeypatch.setenv(P.EVERY_S_ENV, "0")

    def train(work: Path) -> list[str]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
        opt = build_sgd(model, lr=0.1, momentum=0.9, weight_decay=0.0)
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 256, size=(40, 4, 4, 1), dtype=np.uint8), rng.integers(0, 3, size=40)
        kw = {"seed": 1, "mean": [0.5], "std": [0.25], "num_classes": 3}
        loader = BatchLoader(x[:32], y[:32], batch_size=8, train=True, **kw)
        val = BatchLoader(x[32:], y[32:], batch_size=8, train=False, **kw)
        sched = WarmupCosine(opt, total_steps=2 * len(loader), warmup_steps=1)
        lines: list[str] = []
        fit(model, opt, sched, loader, epochs=range(2), work_dir=work, run_hash="h", loss_fn=TrainLoss(0.0),
            val_loader=val, log=lines.append, desc="tiny")  # fmt: skip
        return lines

    lines = train(tmp_path / "a")
    progress = [ln for ln in lines if re.match(r"tiny: epoch \d/2 step \d/4 ", ln)]
    assert [ln.split(" | ")[0] for ln in progress] == [
        f"tiny: epoch {e}/2 step {s}/4 ({25 * s}%)" for e in (1, 2) for s in (1, 2, 3, 4)
    ]
    assert all("val_acc" not in ln for ln in progress[:4]) and all(
        " | val_acc 0." in ln for ln in progress[4:]
    )
    monkeypatch.setenv("TCNN_QUIET", "1")
    quiet = train(tmp_path / "b")
    assert quiet and not [ln for ln in quiet if " step " in ln]
