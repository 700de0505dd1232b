"""Model kinds: every kind through the SAME stage functions (pretrain -> reparam -> finetune -> evaluate), the
checkpoints of every stage reloading via core.training.checkpoint.load_model to the network the stage computed
with; and adding a kind is one registration: a toy two-phase kind registered here (its code named by reference,
"module:attribute", as the built-in records do), and nowhere else, validates in params, pretrains,
reparameterizes, fine-tunes next to its matched control and is evaluated, through the same stage functions; the
registry's records answer what the stages used to branch on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
from _train_helpers import TEST_DEVICE, tiny_params, write_dataset

from core.config import ConfigError, validate_params
from core.data import load_datasets, make_loader
from core.models import kinds
from core.models.factory import build
from core.models.kinds import ModelKind
from core.reparam import gpsa_modules
from core.training.checkpoint import load, load_model
from core.training.model_eval import evaluate
from stages import control, corrupt, finetune, pretrain, reparam
from stages import evaluate as evaluate_stage
from stages.harness import pretraining

ARCH = {"convit": "convit_fmnist", "cmhsa": "cmhsa_fmnist"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Fashion-MNIST (250 train incl. 50 val, 80 test) and its corrupted set (1 corruption x 1 severity)."""
    base = tmp_path_factory.mktemp("kinds")
    data = write_dataset(base / "fmnist", n_train=250, n_test=80)
    raw = tiny_params(data, robustness={"dir": str(base / "fmnist-c"), "n_images": 40,
                                        "corruptions": ["gaussian_noise"], "severities": [2], "workers": 1})  # fmt: skip
    corrupt.run(validate_params(raw), root=Path("/"))
    return {"data": data, "c": base / "fmnist-c"}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)


def _raw(shared: dict[str, Path], kind: str, **options) -> dict:
    raw = tiny_params(
        shared["data"],
        model={"kind": kind, "arch": ARCH.get(kind, "resnet10_cifar"), "options": options},
        pretrain={"epochs": 1, "batch_size": 50},
        reparam={"epoch": 1},
        finetune={"epochs": 1, "batch_size": 50},
        robustness={
            "dir": str(shared["c"]),
            "n_images": 40,
            "corruptions": ["gaussian_noise"],
            "severities": [2],
        },
    )
    raw["data"]["val_size"] = 50
    return raw


def _reloaded_matches(path: Path, loader, loss: float, acc: float) -> None:
    """load_model gives the network the stage evaluated (same loss on the same split) whatever the RNG state
    (nothing random or unsaved enters the rebuilt model)."""
    torch.manual_seed(1)
    a = load_model(path)
    torch.manual_seed(2)
    b = load_model(path)
    x, _ = next(iter(loader.batches(0)))
    with torch.no_grad():
        la, lb = a(x), b(x)
    assert torch.equal(la, lb), f"{path.name}: reloads differ"
    got = evaluate(a, loader.batches(0))
    assert got["acc"] == pytest.approx(acc, abs=1e-9) and got["loss"] == pytest.approx(
        loss, rel=1e-5, abs=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", kinds.kind_names())
def test_every_kind_runs_the_same_stages(kind: str, shared: dict[str, Path], tmp_path: Path) -> None:
    params = validate_params(_raw(shared, kind))
    m_pre = pretrain.run(params, root=tmp_path)
    rep = reparam.run(params, root=tmp_path)
    m_ft = finetune.run(params, root=tmp_path)
    m_ctl = control.run(params, root=tmp_path)
    m_ev = evaluate_stage.run(params, root=tmp_path)

    ds = load_datasets(params.data.dir, val_size=50, sample_fraction=1.0, seed=params.seed)
    test = make_loader(ds, "test", batch_size=500, train=False, seed=0)
    val = make_loader(ds, "val", batch_size=500, train=False, seed=0)
    assert m_pre["steps"] == 4 and 0 <= m_pre["test_acc"] <= 1  # 200 train images / 50 per batch, 1 epoch
    _reloaded_matches(tmp_path / "runs/pretrain/cnn-final.pt", test, m_pre["test_loss"], m_pre["test_acc"])
    _reloaded_matches(tmp_path / "runs/reparam/tcnn.pt", val, rep["val_loss_tcnn"], rep["val_acc_tcnn"])
    _reloaded_matches(tmp_path / "runs/finetune/tcnn-final.pt", test, m_ft["test_loss"], m_ft["test_acc"])
    assert m_ft["epochs_run"] == 1 and m_ft["steps"] == 4

    spec_pre = load(tmp_path / "runs/pretrain/cnn-final.pt")["model_spec"]
    spec = load(tmp_path / "runs/finetune/tcnn-final.pt")["model_spec"]
    assert spec["kind"] == kind and spec_pre["kind"] == params.model.record.pretraining_kind
    assert spec_pre["kind"] == ("cnn" if kind in ("cnn", "tcnn", "psa") else kind)
    if kind in ("tcnn", "psa"):
        assert rep["converted"] and spec["tcnn"]["attention"] == ("psa" if kind == "psa" else "gpsa")
        assert rep["gpsa_layers"] == ["layer4.0.conv1", "layer4.0.conv2"]
        assert rep["max_abs_logit_diff"] >= 0 and rep["max_abs_logit_diff_s1"] >= 0  # both stride modes tried
    elif kind == "cmhsa":
        assert spec_pre["phase"] == "conv" and spec["phase"] == "mhsa" and rep["converted"]
        assert rep["max_abs_logit_diff"] <= 1e-4  # [Li21] Theorem 1 transfer: the function is kept
        assert rep["attention_layers"] and not rep["gpsa_layers"]
    else:
        assert not rep["converted"] and rep["max_abs_logit_diff"] == 0.0
    # The pretraining network's code that dvc.yaml does not list (it lists params.yaml's kind's): recorded, so
    # that a later edit of it refuses the checkpoint (test_an_edit_of_untracked_network_code_refuses_...).
    recorded = load(tmp_path / "runs/pretrain/ckpt/ckpt-epoch-001.pt")["network_code"]
    assert ("core/nn/gpsa.py" in recorded) == (kind in ("hybrid_scratch", "convit"))
    assert (recorded == {}) == (kind in ("cnn", "tcnn", "psa"))
    if kind == "hybrid_scratch":  # the T-CNN architecture was what pretraining trained
        assert spec_pre["tcnn"] == {"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1],
                                    "stride_mode": "exact", "attention": "gpsa"}  # fmt: skip
        assert len(gpsa_modules(load_model(tmp_path / "runs/pretrain/cnn-final.pt"))) == 2

    hist = json.loads((tmp_path / "runs/finetune/history.json").read_text())
    attention = kind not in ("cnn",)
    assert bool(hist[0].get("gpsa")) == attention and bool(hist[-1].get("gpsa")) == attention
    if kind in ("tcnn", "psa", "hybrid_scratch", "convit"):
        layer = next(iter(hist[-1]["gpsa"].values()))
        assert set(layer) == ({"inv_alpha", "nonlocality"} | ({"gate"} if kind != "psa" else set()))
    for m in ("cnn", "tcnn"):
        assert 0 <= m_ev[m]["clean_accuracy"] <= 1
    assert (tmp_path / "results/robustness.parquet").is_file()
    # The matched control exists for the kinds that reparameterize a pretrained network (the same CNN
    # checkpoint fine-tuned without conversion); the others have none and say why.
    assert m_ctl["enabled"] == (kind in ("tcnn", "psa", "cmhsa"))
    assert ("control" in m_ev) == m_ctl["enabled"]
    if m_ctl["enabled"]:
        assert m_ctl["steps"] == m_ft["steps"] and m_ctl["peak_lr"] == m_ft["peak_lr"]
        assert load(control.checkpoint_path(tmp_path))["model_spec"] == spec_pre  # the unconverted network
        assert "tcnn-control" in m_ev["comparisons"]


def test_stage_refuses_a_checkpoint_of_another_kind(shared: dict[str, Path], tmp_path: Path) -> None:
    """reparam with model.kind=psa on a pretraining checkpoint of kind convit: one clear line."""
    from core.models.spec import make_model_spec
    from core.training.checkpoint import atomic_save
    from core.training.optim import optimizer_param_names
    from stages.harness.runner import StageError

    params = validate_params(_raw(shared, "psa"))
    model = build("convit", "convit_fmnist", 10, in_chans=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = make_model_spec("convit", "convit_fmnist", 10, 1, {"img_size": 28})
    ckpt = {"model": model.state_dict(), "model_spec": spec, "optimizer": opt.state_dict(),
            "param_names": optimizer_param_names(opt, model), "scheduler": {}, "rng": {}, "epoch": 1,
            "global_step": 4}  # fmt: skip
    atomic_save(ckpt, tmp_path / "runs/pretrain/ckpt/ckpt-epoch-001.pt")
    with pytest.raises(StageError, match=r"holds a 'convit' model already; model.kind='psa' expects a 'cnn'"):
        reparam.run(params, root=tmp_path)
    assert not (tmp_path / "runs/reparam").exists()


def test_an_edit_of_untracked_network_code_refuses_the_pretraining_checkpoint(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """dvc.yaml lists the code of params.yaml's kind only (an edit of GPSA must not rerun a CNN's pretraining),
    so a hybrid_scratch pretraining (GPSA from scratch) records the GPSA files it was built with; once one
    differs, reparam refuses the checkpoint in one line that says how to rerun, before writing anything."""
    from core.models.spec import build_from_spec
    from core.training.checkpoint import atomic_save
    from core.training.optim import optimizer_param_names
    from stages.harness.identity import network_code
    from stages.harness.runner import StageError

    params = validate_params(_raw(shared, "hybrid_scratch"))
    spec = pretraining.model_spec(params, 10, 1)
    model = build_from_spec(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    code = network_code("pretrain", kinds.get("hybrid_scratch").code())
    assert "core/nn/gpsa.py" in code and not any(
        f in code for f in ("core/models/cnn.py", "core/nn/attention_layers.py")
    )
    ckpt = {"model": model.state_dict(), "model_spec": spec, "optimizer": opt.state_dict(),
            "param_names": optimizer_param_names(opt, model), "scheduler": {}, "rng": {}, "epoch": 1,
            "global_step": 4, "network_code": {**code, "core/nn/gpsa.py": "0" * 64}}  # fmt: skip
    atomic_save(ckpt, tmp_path / "runs/pretrain/ckpt/ckpt-epoch-001.pt")
    with pytest.raises(StageError, match=r"pretrained with another core/nn/gpsa.py .*dvc repro -f pretrain$"):
        reparam.run(params, root=tmp_path)
    assert not (tmp_path / "runs/reparam").exists()


@pytest.mark.parametrize(
    "model,message",
    [
        ({"kind": "cnn", "options": {"gating": "freeze0"}}, "model.options: gating: applies to kinds"),
        ({"kind": "convit", "arch": "convit_fmnist", "options": {"gating": "off"}}, "gating: must be one of"),
        ({"kind": "tcnn", "options": {"alpha_init": 2.0}}, "converts with reparam.alpha_init"),
        ({"kind": "psa", "options": {"qk_init": "ones"}}, "model.options: qk_init: must be one of"),
        ({"kind": "convit", "arch": "resnet10_cifar"}, "model.arch: unknown arch 'resnet10_cifar' for kind"),
        ({"kind": "hybrid_scratch", "options": {"alpha_init": -1}}, "model.options: alpha_init: must be"),
        ({"kind": "convit", "arch": "convit_fmnist", "options": {"conv_init": "no"}}, "conv_init: must be"),
    ],
)
def test_kind_options_are_validated(model: dict, message: str, shared: dict[str, Path]) -> None:
    raw = tiny_params(shared["data"], model=model)
    with pytest.raises(ConfigError) as err:
        validate_params(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


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


def _toy_raw(base: Path, kind: str) -> dict:
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
    params = validate_params(_toy_raw(tmp_path, toy_kind.name))
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
        validate_params(_toy_raw(tmp_path, "toy_tempered"))
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
