"""The matched control: the same pretrained checkpoint fine-tuned with the T-CNN's recipe, only the
reparameterization differs ([TCNN21] Table 1, "without SA")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _train_helpers import TEST_DEVICE, tiny_params, write_dataset

from core.config import validate_params
from core.data import first_batch, load_datasets, make_loader
from core.training.checkpoint import load, load_model
from stages import control, finetune, pretrain, reparam
from stages.harness import training as T

# GPSA parameters a CNN does not have (W_qry, W_key, W_val live in qkv_weight).
ATTENTION_ONLY = ("qkv_weight", "gating_param", "pos_alpha", "pos_center")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "fmnist")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)


def _probe(params: Any, n: int = 64) -> torch.Tensor:
    ds = load_datasets(params.data.dir, val_size=params.data.val_size, sample_fraction=1.0, seed=params.seed)
    return first_batch(make_loader(ds, "test", batch_size=n, train=False, seed=0), n)


def _record_loaders(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every T.loaders call of the fine-tuning runs: its arguments and the first training batch."""
    calls: list[dict[str, Any]] = []
    real = T.loaders

    def spy(ds: Any, **kw: Any) -> T.Loaders:
        out = real(ds, **kw)
        x, y = out.train.batch(0, 0)
        calls.append({**kw, "augment": kw["augment"].model_dump(), "first_x": x, "first_y": y,
                      "order": out.train.order(1).copy(), "steps": len(out.train)})  # fmt: skip
        return out

    monkeypatch.setattr(T, "loaders", spy)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["resnet10_cifar", "resnet10_cifar_os16"])
def test_only_the_reparameterization_differs(tmp_path, data_dir, monkeypatch, arch) -> None:
    """alpha = lambda = 50 (the GPSA computes the conv) and the attention-only parameters frozen: a few
    AdamW steps of the T-CNN and of the control train the same filters on the same batches with the same
    stochastic-depth masks, so their logits stay within 1e-3. The recipes are equal argument by argument."""
    raw = tiny_params(
        data_dir,
        model={"kind": "tcnn", "arch": arch},
        pretrain={"epochs": 1},
        reparam={"epoch": 1, "alpha_init": 50.0, "lambda_init": 50.0},
        finetune={"epochs": 1, "freeze": list(ATTENTION_ONLY), "drop_path": 0.1},
    )
    params = validate_params(raw)
    pretrain.run(params, root=tmp_path)
    reparam.run(params, root=tmp_path)
    calls = _record_loaders(monkeypatch)
    m_t = finetune.run(params, root=tmp_path)
    m_c = control.run(params, root=tmp_path)
    assert m_c["enabled"] is True and len(calls) == 2
    a, b = calls
    for key in ("batch_size", "seed", "augment", "size", "steps", "num_workers"):
        assert a[key] == b[key], key
    assert torch.equal(a["first_x"], b["first_x"]) and torch.equal(a["first_y"], b["first_y"])
    assert (a["order"] == b["order"]).all()  # the same data order in later epochs too
    for key in ("mode", "epochs_run", "peak_lr", "steps", "image_size"):
        assert m_t[key] == m_c[key], key
    assert m_t["frozen_parameters"] == 2 * len(ATTENTION_ONLY) and m_c["frozen_parameters"] == 0

    x = _probe(params)
    with torch.no_grad():
        t = load_model(tmp_path / "runs" / "finetune" / "tcnn-final.pt")(x)
        c = load_model(control.checkpoint_path(tmp_path))(x)
        start = load_model(tmp_path / "runs" / "pretrain" / "ckpt" / "ckpt-epoch-001.pt")(x)
    assert (c - start).abs().max() > 1e-2  # the steps really moved the network
    assert (t - c).abs().max() <= 1e-3


@pytest.mark.slow
def test_continue_mode_control_is_the_cnn_run_continued(tmp_path, data_dir) -> None:
    """[TCNN21] Table 3's CNN row: in "continue" mode the control is the pretraining run continued for the same t2
    epochs from t1 -- with the carried SGD state, schedule, RNG and data order it reproduces the pretraining
    run's own final CNN exactly (bitwise on CPU)."""
    raw = tiny_params(data_dir, pretrain={"epochs": 3}, reparam={"epoch": 1}, finetune={"mode": "continue"})
    params = validate_params(raw)
    pretrain.run(params, root=tmp_path)
    m = control.run(params, root=tmp_path)
    assert m["t1"] == 1 and m["t2"] == 2 and m["epochs_run"] == 2
    ours = load(control.checkpoint_path(tmp_path))["model"]
    theirs = load(tmp_path / "runs" / "pretrain" / "cnn-final.pt")["model"]
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    hist_c = json.loads((tmp_path / "runs" / "control" / "history.json").read_text())
    hist_p = json.loads((tmp_path / "runs" / "pretrain" / "history.json").read_text())
    assert [r["lr"] for r in hist_c[1:]] == [r["lr"] for r in hist_p[1:]]


@pytest.mark.parametrize(
    ("change", "reason"),
    [({"finetune": {"control": False}}, "finetune.control is false"), ({"model": {"kind": "convit",
      "arch": "convit_fmnist"}}, "already the control")],
)  # fmt: skip
def test_no_control_writes_empty_outputs_and_says_why(tmp_path, data_dir, change, reason) -> None:
    params = validate_params(tiny_params(data_dir, **change))
    m = control.run(params, root=tmp_path)
    assert m["enabled"] is False and reason in m["reason"]
    out = tmp_path / "runs" / "control"
    assert json.loads((out / "metrics.json").read_text()) == m
    assert list((out / "model").iterdir()) == []  # the DVC out exists, without a model
    assert json.loads((out / "history.json").read_text()) == []


def test_control_needs_the_pretraining_checkpoint(tmp_path, data_dir, monkeypatch, capsys) -> None:
    from _train_helpers import write_params

    path = write_params(tmp_path / "params.yaml", tiny_params(data_dir))
    monkeypatch.chdir(tmp_path)
    assert control.main(["--params", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("control: error:") and "ckpt-epoch-001.pt" in err
    assert not (tmp_path / "runs" / "control").exists()
