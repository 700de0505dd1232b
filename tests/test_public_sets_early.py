"""Issue 59: a published robustness set (CIFAR-10-C layout) is checked from its .npy headers and labels at
`tcnn validate` before the data is prepared (the shape and classes the dataset's name gives), and by the
training stages before they train, not only at evaluate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _train_helpers import stage_env

from core.config import load_params
from stages.harness.runner import StageError
from stages.robustness_bench import check_public_before_training, check_public_sets

PUBLIC = "robustness.public={kind: cifar10_c, dir: pub, use: add}"
SETS = ["data.name=cifar10", "data.dir=data/not-prepared", "robustness.dir=data/c", PUBLIC]


def cifar_c(root: Path, shape: tuple[int, ...], labels: np.ndarray) -> None:
    (root / "pub").mkdir(exist_ok=True)
    for c in ("gaussian_noise", "contrast"):
        np.save(root / "pub" / f"{c}.npy", np.zeros(shape, np.uint8))
    np.save(root / "pub" / "labels.npy", labels)


def test_a_published_set_is_checked_before_the_data_is_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    cifar_c(tmp_path, (50, 32, 32, 3), np.arange(50) % 10)
    params = load_params("params.yaml", SETS)
    check_public_sets(params, prepared=False)  # CIFAR-10's 32 x 32 x 3 and 10 classes: it fits
    check_public_before_training(params)
    cifar_c(tmp_path, (50, 28, 28, 3), np.arange(50) % 10)
    with pytest.raises(StageError, match=r"^robustness\.public: pub/contrast\.npy: uint8 \[50, 28, 28, 3\]; the "
                       r"clean test images are uint8 \[N, 32, 32, 3\]"):  # fmt: skip
        check_public_before_training(params)
    cifar_c(tmp_path, (50, 32, 32, 3), np.arange(50) % 11)
    with pytest.raises(StageError, match=r"pub/labels\.npy: labels 0\.\.10 outside the dataset's 0\.\.9"):
        check_public_sets(params, prepared=False)
    with pytest.raises(StageError, match=r"^data\.dir: .* \(run the prepare stage\)"):
        check_public_sets(params)  # evaluate's check: the prepared data must be there
    p = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", *[a for s in SETS for a in ("-S", s)]],
                       cwd=tmp_path, env=stage_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "tcnn validate: error: robustness.public: pub/labels.npy: labels 0..10 outside the dataset's 0..9"
    ]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["params.yaml", "pub"]
