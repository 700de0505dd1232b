"""Issue 59: a published robustness set (CIFAR-10-C layout) is checked from its .npy headers and labels at
`tcnn validate` before the data is prepared (the shape and classes the dataset's name gives), and under
`dvc repro` by the check stage (stages/check.py) after prepare and before pretrain, not only at evaluate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _train_helpers import stage_env

from core.config import load_params
from stages.harness.runner import StageError
from stages.published_check import check_public_before_training, check_public_sets

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


def test_dvc_repro_refuses_a_published_set_at_the_check_stage_before_pretraining(tmp_path: Path) -> None:
    """Under `dvc repro` the check stage (after prepare, before pretrain) refuses a CIFAR-10-C copy of 28 px
    images against the prepared CIFAR-10's 32 px in one line, and pretraining never starts; a fitting copy
    passes, writing the file pretrain depends on, whose bytes never change. The published-set reader is no
    import of pretrain, so an edit of it reruns the check alone."""
    from _pipeline_repo import dvc, make_repo
    from test_data_importers import make_cifar10
    from test_dvc_deps import imported_files

    from stages.check import PASSED

    assert "core/robustness/public_sets.py" in imported_files("check")
    assert "core/robustness/public_sets.py" not in imported_files("pretrain")
    repo = tmp_path / "repo"
    repo.mkdir()
    make_cifar10(repo / "c.tar.gz")  # a tiny CIFAR-10 archive: 60 training, 15 test images of 32 px
    cifar_c(repo, (15, 28, 28, 3), np.arange(15) % 10)
    make_repo(repo, {"data": {"name": "cifar10", "source": "c.tar.gz", "dir": "data/cifar10", "image_size": 32},
                     "robustness": {"public": {"kind": "cifar10_c", "dir": "pub", "use": "add"}}})  # fmt: skip
    out = dvc(repo, "repro", check=False)
    said = [line for line in out.stderr.splitlines() if line.startswith("check:")]
    assert out.returncode != 0 and said == [
        "check: error: robustness.public: pub/contrast.npy: uint8 [15, 28, 28, 3]; the clean test images are "
        "uint8 [N, 32, 32, 3] (channels last)"
    ], out.stdout + out.stderr
    assert "Running stage 'prepare'" in out.stdout and "Running stage 'pretrain'" not in out.stdout
    assert (
        not (repo / "runs" / "pretrain").exists() and not (repo / "runs" / "check" / "passed.json").exists()
    )
    cifar_c(repo, (15, 32, 32, 3), np.arange(15) % 10)
    out = dvc(repo, "repro", "check")
    assert "check: ok (robustness.public pub)" in out.stdout
    assert json.loads((repo / "runs" / "check" / "passed.json").read_text()) == PASSED
