"""Adding a model kind is one registration: a toy two-phase kind registered here (its code named by reference,
"module:attribute", as the built-in records do), and nowhere else, validates
in params, pretrains, reparameterizes, fine-tunes next to its matched control and is evaluated, through the same
stage functions as the project's kinds; the registry's records answer what the stages used to branch on."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
from _train_helpers import TEST_DEVICE, tiny_params, write_dataset

from core.config import ConfigError, validate_params
from core.models import kinds
from core.models.kinds import ModelKind
from core.training.checkpoint import load, load_model
from stages import control, corrupt, finetune, pretrain, reparam
from stages import evaluate as evaluate_stage


class Tempered(nn.Module):
    """The toy kind's second phase: the first phase's network times a learnable temperature, starting at 1
    (so the reparameterization keeps the function exactly)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.temperature


def build_toy(arch: str, num_classes: int, *, phase: str = "plain", **options) -> nn.Module:
    net = timm.create_model(arch, num_classes=num_classes, **options)
    return net if phase == "plain" else Tempered(net)


TOY = ModelKind(
    "toy_tempered", f"{__name__}:build_toy", "a CNN that learns a softmax temperature after pretraining",
    reparameterize=f"{__name__}:Tempered", phases=("plain", "tempered"),
)  # fmt: skip


@pytest.fixture
def toy_kind():
    kinds.register(TOY)
    yield TOY
    kinds.unregister(TOY.name)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)


def _raw(base: Path, kind: str) -> dict:
    data = write_dataset(base / "fmnist", n_train=250, n_test=80)
    robustness = {"dir": str(base / "fmnist-c"), "n_images": 40, "corruptions": ["gaussian_noise"],
                  "severities": [2], "workers": 1}  # fmt: skip
    raw = tiny_params(
        data,
        model={"kind": kind, "arch": "resnet10_cifar"},
        pretrain={"epochs": 1, "batch_size": 50},
        reparam={"epoch": 1},
        finetune={"epochs": 1, "batch_size": 50},
        robustness=robustness,
    )
    raw["data"]["val_size"] = 50
    return raw


def test_a_kind_registered_in_one_place_runs_the_chain(toy_kind: ModelKind, tmp_path: Path) -> None:
    params = validate_params(_raw(tmp_path, toy_kind.name))
    corrupt.run(params, root=Path("/"))
    pretrain.run(params, root=tmp_path)
    rep = reparam.run(params, root=tmp_path)
    m_ft = finetune.run(params, root=tmp_path)
    m_ctl = control.run(params, root=tmp_path)
    m_ev = evaluate_stage.run(params, root=tmp_path)

    spec_pre = load(tmp_path / "runs/pretrain/cnn-final.pt")["model_spec"]
    spec = load(tmp_path / "runs/finetune/tcnn-final.pt")["model_spec"]
    assert (spec_pre["kind"], spec_pre["phase"]) == ("toy_tempered", "plain")
    assert (spec["kind"], spec["phase"]) == ("toy_tempered", "tempered")
    assert isinstance(load_model(tmp_path / "runs/finetune/tcnn-final.pt"), Tempered)
    # Temperature 1 keeps the function: the converted network's logits are the CNN's.
    assert rep["converted"] and rep["max_abs_logit_diff"] == 0.0
    assert rep["val_acc_cnn"] == rep["val_acc_tcnn"]
    # It reparameterizes a pretrained network, so it has a matched control: the plain network fine-tuned alike.
    assert m_ctl["enabled"] and m_ctl["steps"] == m_ft["steps"]
    assert load(control.checkpoint_path(tmp_path))["model_spec"] == spec_pre
    assert "tcnn-control" in m_ev["comparisons"] and 0 <= m_ev["tcnn"]["clean_accuracy"] <= 1


def test_an_unregistered_kind_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        validate_params(_raw(tmp_path, "toy_tempered"))
    assert str(err.value).startswith("model.kind: Input should be 'cnn', ") and "\n" not in str(err.value)


def test_records_answer_what_the_stages_ask() -> None:
    """The facts of the project's kinds (DESIGN: which kinds have a control, pretrain a CNN, convert how),
    stated here independently of the records."""
    has_control = {k.name for k in kinds.all_kinds() if k.has_control}
    assert has_control == {"tcnn", "psa", "cmhsa"}
    assert {k.name: k.pretraining_kind for k in kinds.all_kinds()} == {
        "cnn": "cnn", "tcnn": "cnn", "psa": "cnn", "hybrid_scratch": "hybrid_scratch", "convit": "convit",
        "aa_resnet": "aa_resnet", "cmhsa": "cmhsa",
    }  # fmt: skip
    assert {k.name for k in kinds.all_kinds() if k.final_is_tcnn} == {"tcnn", "hybrid_scratch"}
    assert {k.name for k in kinds.all_kinds() if k.pretrains_attention} == {"hybrid_scratch"}
    with pytest.raises(ValueError, match="registered already"):
        kinds.register(kinds.get("tcnn"))
    with pytest.raises(ValueError, match="unknown model kind 'vit'"):
        kinds.get("vit")
