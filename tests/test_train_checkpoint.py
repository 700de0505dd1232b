"""core.training.checkpoint: atomic writes, one-line errors on bad files, models rebuilt from their spec, RNG states."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from core.models.factory import build
from core.models.spec import build_from_spec, make_model_spec
from core.reparam import to_tcnn
from core.training.checkpoint import CheckpointError, atomic_save, capture_rng, load, load_model, restore_rng
from core.utils.atomic import atomic_write


def _spec(tcnn: dict | None = None) -> dict:
    return make_model_spec("tcnn" if tcnn else "cnn", "resnet10_cifar", 10, 1, {}, tcnn)


def test_atomic_save_roundtrip_leaves_no_temp_files(tmp_path: Path) -> None:
    obj = {"model": {"w": torch.arange(6.0).view(2, 3)}, "epoch": 3, "names": ["a", "b"]}
    path = atomic_save(obj, tmp_path / "sub" / "ckpt.pt")
    got = load(path)
    assert (
        torch.equal(got["model"]["w"], obj["model"]["w"]) and got["epoch"] == 3 and got["names"] == ["a", "b"]
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path: Path) -> None:
    path = atomic_save({"v": torch.tensor([1.0])}, tmp_path / "ckpt.pt")
    before = path.read_bytes()

    def half_then_crash(f) -> None:
        f.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_crash)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_publish_removes_temps_a_killed_publish_left(tmp_path: Path) -> None:
    """A SIGKILL during atomic_write leaves its temp file (nobody is left to remove it); the next publish of
    the stage's outputs clears those and only those."""
    from stages.harness.training import publish

    out = tmp_path / "runs" / "finetune"
    (out / "ckpt").mkdir(parents=True)
    stale = [
        out / ".tcnn-final.pt.kzy2bki4.tmp",
        out / "ckpt" / ".ckpt-epoch-001.pt.a1b2.tmp",
        out / ".x.pt.publish",
    ]
    for f in stale:
        f.write_bytes(b"half a checkpoint")
    (out / "notes.txt").write_text("a user's file stays")
    publish(None, out, objects={"tcnn-final.pt": {"v": torch.tensor([1.0])}}, metrics={"test_acc": 0.5})
    assert not any(f.exists() for f in stale)
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == [
        "metrics.json",
        "notes.txt",
        "tcnn-final.pt",
    ]


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated", "garbage", "not_a_dict", "directory"])
def test_load_fails_with_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt-epoch-003.pt"
    full = {"model": build("cnn", "resnet10_cifar", 10, in_chans=1).state_dict(), "model_spec": _spec()}
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        atomic_save(full, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "not_a_dict":
        atomic_save([torch.zeros(2)], path)
    elif damage == "directory":
        path.mkdir()
    with pytest.raises(CheckpointError) as err:
        load(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg


def test_load_names_missing_keys(tmp_path: Path) -> None:
    path = atomic_save({"model": {}}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"c\.pt: checkpoint lacks key\(s\) \['model_spec'\]"):
        load(path, require=("model", "model_spec"))


def test_load_model_rebuilds_a_cnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cnn = build("cnn", "resnet10_cifar", 10, in_chans=1)
    cnn.train()
    cnn(torch.randn(8, 1, 28, 28))  # move BN running stats away from their init
    cnn.eval()
    path = atomic_save({"model": cnn.state_dict(), "model_spec": _spec()}, tmp_path / "cnn.pt")
    got = load_model(path)
    x = torch.randn(4, 1, 28, 28)
    assert not got.training
    with torch.no_grad():
        assert torch.equal(got(x), cnn(x))


def test_load_model_rebuilds_a_tcnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tcnn_cfg = {"alpha_init": 2.0, "lambda_init": 0.5, "stages": [-1], "stride_mode": "exact"}
    tcnn = to_tcnn(build("cnn", "resnet10_cifar", 10, in_chans=1), **{**tcnn_cfg, "stages": (-1,)}).eval()
    with torch.no_grad():  # make the state differ from what to_tcnn would produce again
        for name, p in tcnn.named_parameters():
            if name.endswith("gating_param"):
                p.add_(torch.randn_like(p))
    path = atomic_save({"model": tcnn.state_dict(), "model_spec": _spec(tcnn_cfg)}, tmp_path / "tcnn.pt")
    got = load_model(path)
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(got(x), tcnn(x))
    assert type(got.layer4[0].conv2).__name__ == "TcnnGPSA"


def test_load_model_rejects_weights_of_another_model(tmp_path: Path) -> None:
    cnn = build("cnn", "resnet10_cifar", 10, in_chans=1)
    path = atomic_save(
        {"model": cnn.state_dict(), "model_spec": {**_spec(), "num_classes": 7}}, tmp_path / "x.pt"
    )
    with pytest.raises(CheckpointError, match=r"x\.pt: weights do not fit"):
        load_model(path)


def test_build_from_spec_rejects_incomplete_spec() -> None:
    with pytest.raises(ValueError, match="lacks"):
        build_from_spec({"kind": "cnn", "arch": "resnet10_cifar"})


def test_rng_state_roundtrip_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # leave a cached gaussian in numpy's state
    path = atomic_save({"rng": capture_rng()}, tmp_path / "rng.pt")
    expected = (torch.rand(5), np.random.rand(5), np.random.normal(), [random.random() for _ in range(5)])
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    restore_rng(load(path)["rng"])
    got = (torch.rand(5), np.random.rand(5), np.random.normal(), [random.random() for _ in range(5)])
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2] and got[3] == expected[3]
