"""Any pretrained CNN in, its T-CNN out: timm and torchvision weights, a user's own architecture and
checkpoint, another number of classes, and every bad input refused with one line.

Every checkpoint here is made by the test (no download, no ../shared): a network with perturbed BatchNorm
statistics (so an ignored buffer shows), saved the way people save them. The truths are the saved network's
own outputs and the conversion's exactness at alpha = lambda = 50 (T-CNN, d'Ascoli et al. 2021, Sec. 2).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
import torchvision
import yaml
from _train_helpers import repo_pythonpath, stage_env, tiny_params, write_dataset, write_params

from core.analysis.equivalence import features_before
from core.config import ConfigError, SourceConfig, validate_params
from core.models.builders import classifier
from core.models.cnn_layout import conversion_targets
from core.models.conversion import to_tcnn
from core.models.importing import IMAGENET_MEAN, ImportError_, import_cnn, normalization
from core.models.spec import build_from_spec, make_model_spec
from pipelines.sweep.sweep_params import validate_sweep_params

LARGE = {"alpha_init": 50.0, "lambda_init": 50.0}


def _perturb_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
            m.weight.data.copy_(0.5 + torch.rand(m.num_features, generator=g))
    return model.eval()


def _save(obj: object, path: Path) -> SourceConfig:
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(obj, str(path))
    else:
        torch.save(obj, path)
    return SourceConfig(weights=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


X = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fmt", [".pth", ".safetensors"])
def test_a_timm_state_dict_imports_exactly_and_its_tcnn_matches(tmp_path: Path, fmt: str) -> None:
    net = _perturb_bn(timm.create_model("resnet18", num_classes=10))
    source = _save(net.state_dict(), tmp_path / f"r18{fmt}")
    imported = import_cnn("resnet18", source, 10, 3)
    assert not imported.head_replaced and imported.classifier == "fc"
    assert torch.equal(_logits(imported.model, X), _logits(net, X))  # BN buffers loaded, not re-initialised
    tcnn = to_tcnn(imported.model, **LARGE)
    assert (_logits(tcnn, X) - _logits(net, X)).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ["resnet18", "torchvision.models:resnet18"])
def test_a_torchvision_state_dict_imports_by_timm_name_or_builder(tmp_path: Path, arch: str) -> None:
    tv = _perturb_bn(torchvision.models.resnet18(num_classes=10))
    source = _save(tv.state_dict(), tmp_path / "tv18.pth")
    imported = import_cnn(arch, source, 10, 3)
    assert torch.allclose(_logits(imported.model, X), _logits(tv, X), atol=1e-5, rtol=0)
    assert (_logits(to_tcnn(imported.model, **LARGE), X) - _logits(tv, X)).abs().max() < 1e-4


def test_normalization_follows_the_checkpoint() -> None:
    file = SourceConfig.model_construct(weights="x.pth", sha256="0" * 64, mean=None, std=None)
    assert normalization("torchvision.models:resnet50", file)["mean"] == list(IMAGENET_MEAN)
    timm_cfg = timm.models.get_pretrained_cfg("resnet50").to_dict()
    got = normalization("resnet50", file)
    assert got["mean"] == list(timm_cfg["mean"]) and got["from"] == "timm pretrained_cfg"
    own = SourceConfig.model_construct(weights="x.pth", sha256="0" * 64, mean=[0.5], std=[0.25])
    assert normalization("mynets:net", own) == {"mean": [0.5], "std": [0.25], "from": "pretrain.source"}
    assert (
        normalization("mynets:net", file) == {}
    )  # a user's builder states its own (params refuse it otherwise)


@pytest.mark.parametrize("wrap", ["state_dict", "model"])
def test_a_training_script_dict_with_dataparallel_prefixes_imports(tmp_path: Path, wrap: str) -> None:
    net = _perturb_bn(timm.create_model("resnet18", num_classes=10))
    state = {f"module.{k}": v for k, v in net.state_dict().items()}
    source = _save({wrap: state, "epoch": 90, "best_acc1": 0.7}, tmp_path / "ckpt.pth")
    assert torch.equal(_logits(import_cnn("resnet18", source, 10, 3).model, X), _logits(net, X))


def test_a_1000_class_checkpoint_on_10_classes_replaces_the_head_and_keeps_the_features(
    tmp_path: Path,
) -> None:
    net = _perturb_bn(timm.create_model("resnet18", num_classes=1000))
    source = _save(net.state_dict(), tmp_path / "in1k.pth")
    imported = import_cnn("resnet18", source, 10, 3)
    assert imported.head_replaced and imported.source_classes == 1000
    assert imported.notes == [
        "classifier 'fc' replaced: 1000 classes in the checkpoint, 10 in the dataset (a new nn.Linear; every "
        "other weight kept)"
    ]
    assert classifier(imported.model)[1].out_features == 10
    feats = features_before(imported.model, X, "fc")
    assert torch.equal(feats, features_before(net, X, "fc"))
    kept = {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}
    assert all(torch.equal(imported.model.state_dict()[k], v) for k, v in kept.items())
    assert (features_before(to_tcnn(imported.model, **LARGE), X, "fc") - feats).abs().max() < 1e-4
    # what the checkpoint spec rebuilds holds the imported weights (the 10-way head included)
    rebuilt = build_from_spec(make_model_spec("cnn", "resnet18", 10, 3))
    rebuilt.load_state_dict(imported.model.state_dict())
    assert torch.equal(_logits(rebuilt, X), _logits(imported.model, X))
    # the new head is drawn from the file's sha256: the same for every seed, reproducible
    again = import_cnn("resnet18", source, 10, 3).model
    assert torch.equal(again.fc.weight, imported.model.fc.weight)


# ------------------------------------------------------------------------------------------- bad inputs


def _small_state(tmp_path: Path) -> tuple[nn.Module, Path]:
    net = _perturb_bn(timm.create_model("resnet18", num_classes=10))
    path = tmp_path / "r18.pth"
    torch.save(net.state_dict(), path)
    return net, path


def _source(path: Path, sha: str | None = None) -> SourceConfig:
    return SourceConfig(weights=str(path), sha256=sha or hashlib.sha256(path.read_bytes()).hexdigest())


def test_bad_checkpoints_are_refused_with_one_line(tmp_path: Path) -> None:
    net, path = _small_state(tmp_path)
    with pytest.raises(
        ImportError_, match=r"sha256 [0-9a-f]{64} does not match pretrain.source.sha256 0{64}"
    ):
        import_cnn("resnet18", _source(path, "0" * 64), 10, 3)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ImportError_, match="cut.pth: not a readable checkpoint"):
        import_cnn("resnet18", _source(cut), 10, 3)
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    with pytest.raises(ImportError_, match="notes.pth: not a readable checkpoint"):
        import_cnn("resnet18", _source(text), 10, 3)
    empty = tmp_path / "empty.pth"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(ImportError_, match="holds no state dict of tensors"):
        import_cnn("resnet18", _source(empty), 10, 3)
    # a state dict under a key no loader knows: the keys found, the wrappers accepted, what to do
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"net": net.state_dict(), "epoch": 3, "best_acc": torch.tensor(0.9)}, wrapped)
    with pytest.raises(ImportError_) as info:
        import_cnn("resnet18", _source(wrapped), 10, 3)
    line = str(info.value)
    assert (
        "\n" not in line and "its top-level keys: 'net' (OrderedDict), 'epoch' (int), 'best_acc'" in line
    ), line
    assert "accepted: a state dict, or one under state_dict_ema / model_ema / state_dict / model" in line, (
        line
    )
    assert "torch.save(ckpt[KEY], 'weights.pth')" in line
    torch.save(net.state_dict(), wrapped)  # re-saved as the line says: it imports
    import_cnn("resnet18", _source(wrapped), 10, 3)


def test_keys_and_shapes_that_do_not_fit_are_named(tmp_path: Path) -> None:
    net, _ = _small_state(tmp_path)
    state = dict(net.state_dict())
    state.pop("layer1.0.conv1.weight")
    state.pop("layer2.0.bn1.running_var")
    state["extra.weight"] = torch.zeros(1)
    keys = tmp_path / "keys.pth"
    torch.save(state, keys)
    with pytest.raises(ImportError_) as err:
        import_cnn("resnet18", _source(keys), 10, 3)
    msg = str(err.value)
    assert "\n" not in msg
    assert (
        "keys do not fit resnet18: 2 missing (first 'layer1.0.conv1.weight'), 1 unexpected (first 'extra.weight')"
        in msg
    )
    wide = timm.create_model("resnet18", num_classes=10, in_chans=1).state_dict()
    shapes = tmp_path / "shapes.pth"
    torch.save(wide, shapes)
    with pytest.raises(
        ImportError_,
        match=r"shape of 'conv1.weight' is \(64, 1, 7, 7\) in the file, \(64, 3, 7, 7\) in resnet18",
    ):
        import_cnn("resnet18", _source(shapes), 10, 3)


def test_builders_that_cannot_be_imported_or_build_no_module_are_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "badnets.py").write_text("def not_a_net(num_classes=10):\n    return {'weights': 1}\n")
    _, path = _small_state(tmp_path)
    src = {"weights": str(path), "sha256": _source(path).sha256, "mean": [0.5] * 3, "std": [0.25] * 3}
    base = {"model": {"kind": "tcnn", "arch": "nosuchpkg.nets:resnet"}, "pretrain": {"source": src}}
    with pytest.raises(
        ConfigError, match=r"^model.arch: cannot import 'nosuchpkg.nets' \(ModuleNotFoundError"
    ):
        validate_params(base)
    base["model"]["arch"] = "badnets:missing"
    with pytest.raises(ConfigError, match="model.arch: module 'badnets' has no 'missing'"):
        validate_params(base)
    with pytest.raises(ImportError_, match=r"badnets:not_a_net returned dict, not a torch nn.Module"):
        import_cnn("badnets:not_a_net", _source(path), 10, 3)


def test_the_docs_pattern_example_names_convs_of_torchvision_vgg11() -> None:
    """docs/configuration.md's example pattern for a net that is not ResNet-like converts what it says."""
    import re

    text = " ".join((Path(__file__).parents[1] / "docs" / "configuration.md").read_text().split())
    (pattern,) = re.findall(r'reparam\.stages: \["(features[^"]+)"\]', text)
    net = torchvision.models.vgg11(num_classes=10)
    assert [name for name, _ in conversion_targets(net, [pattern])] == ["features.16", "features.18"]


def test_a_net_run_at_another_size_than_its_config_names_says_so() -> None:
    """timm's resnet18 was trained at 224 px (its pretrained_cfg): run at 32 px, the import says so (a note the
    pretrain stage prints and records in metrics.json ``notes``); at 224 px, or a builder of unknown size: nothing."""
    from core.models.importing import size_note

    assert timm.models.get_pretrained_cfg("resnet18").input_size[-1] == 224
    assert size_note("resnet18", 32) == (
        "resnet18 was trained at 224 px (its pretrained config's input_size) and runs here at 32 px "
        "(data.image_size): its accuracy need not match the one reported for it"
    )
    assert size_note("resnet18", 224) is None and size_note("core.models.he_cifar:resnet20", 32) is None


def test_a_sha256_has_one_spelling(tmp_path: Path) -> None:
    """The digest as sha256sum prints it (lower case) is the only spelling: DVC compares the params' text, so an
    upper-case copy of the same digest would rerun every stage that reads it."""
    _, path = _small_state(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    base = {"model": {"kind": "tcnn", "arch": "resnet18"}}
    ok = validate_params({**base, "pretrain": {"source": {"weights": str(path), "sha256": digest}}})
    assert ok.pretrain.source.sha256 == digest
    with pytest.raises(
        ConfigError, match=f"write the sha256 in lower case, as sha256sum prints it: {digest}$"
    ):
        validate_params({**base, "pretrain": {"source": {"weights": str(path), "sha256": digest.upper()}}})


def test_no_convertible_conv_in_the_stages_asked_for_is_refused() -> None:
    net = timm.create_model("resnet18", num_classes=10)
    with pytest.raises(ValueError, match=r"no k x k convolution \(k > 1\) matches 'head\.\*'") as info:
        to_tcnn(net, stages=["head.*"])
    # the convs a pattern could name, the deepest first, so the user can write one that matches
    assert "its k x k convolutions, last first: layer4.1.conv2, layer4.1.conv1, layer4.0.conv2," in str(
        info.value
    )
    assert "(and 5 earlier)" in str(info.value)  # resnet18: 17 k x k convs, 12 shown
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    with pytest.raises(ValueError, match="has no ResNet stages"):
        to_tcnn(plain, stages=[-1])
    one_by_one = nn.Module()
    one_by_one.layer1 = nn.Sequential(nn.Conv2d(3, 8, 1))
    with pytest.raises(ValueError, match=r"no k x k convolutions \(k > 1\) in stages \[0\]"):
        to_tcnn(one_by_one, stages=[-1])


def test_module_name_patterns_convert_a_net_that_is_not_resnet_like() -> None:
    torch.manual_seed(0)
    net = torchvision.models.vgg11(num_classes=10).features[:8].eval()  # no layerN stages
    tcnn = to_tcnn(net, stages=["6"], **LARGE)
    assert type(tcnn[6]).__name__ == "TcnnGPSA" and isinstance(tcnn[3], nn.Conv2d)
    x = torch.randn(2, 3, 32, 32)
    assert (_logits(tcnn, x) - _logits(net, x)).abs().max() < 1e-4


def test_params_refuse_what_an_import_rules_out(tmp_path: Path) -> None:
    _, path = _small_state(tmp_path)
    src = {"weights": str(path), "sha256": _source(path).sha256}
    base = {"model": {"kind": "tcnn", "arch": "resnet18"}, "pretrain": {"source": src}}
    assert validate_params(base).t1() == 0
    cases = {
        "sweep.grid.reparam.epoch: the CNN is imported": {"sweep": {"grid": {"reparam.epoch": [0, 1]}}},
        "finetune.mode: 'continue' resumes a pretraining run": {"finetune": {"mode": "continue"}},
        "pretrain.source: imports a CNN for model.kind": {
            "model": {"kind": "convit", "arch": "convit_fmnist"}
        },
    }
    for message, extra in cases.items():
        raw = yaml.safe_load(yaml.safe_dump(base))
        for k, v in extra.items():
            raw.setdefault(k, {}).update(v)
        with pytest.raises(ConfigError, match=message):
            validate_sweep_params(raw)  # the whole file, its sweep section too
    with pytest.raises(ConfigError, match="sha256: required for a weights file"):
        validate_params({"pretrain": {"source": {"weights": str(path)}}})
    with pytest.raises(ConfigError, match="pretrain.source.mean: 'torch.nn:Conv2d' is a user's builder"):
        validate_params({"model": {"arch": "torch.nn:Conv2d"}, "pretrain": {"source": src}})


# ---------------------------------------------------------------------------- the stage: one line, exit 2


NET = """
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        return (y + (x if self.down is None else self.down(x))).relu()


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, 2, 1, bias=False)  # 28 px -> 14: layer2 attends over 14x14, then 7x7
        self.layer1 = nn.Sequential(Block(8, 8))
        self.layer2 = nn.Sequential(Block(8, 16, 2))
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def small(num_classes=10):
    return Net(num_classes)


def broken():
    return "not a module"
"""


def write_builder(folder: Path, name: str = "mynets") -> str:
    """The user's own builder module, written into the workspace ``folder``; returns its module name."""
    (folder / f"{name}.py").write_text(NET)
    return name


def save_user_checkpoint(folder: Path, seed: int = 0, classes: int = 10) -> tuple[Path, str]:
    """``{"state_dict": ...}`` with DataParallel's ``module.`` prefixes, as a training script saves it."""
    sys.path.insert(0, str(folder))
    try:
        import importlib

        mod = importlib.import_module("mynets")
        importlib.reload(mod)
        torch.manual_seed(seed)
        net = _perturb_bn(mod.small(classes), seed)
    finally:
        sys.path.remove(str(folder))
    path = folder / "data" / "pretrained" / "mine.pth"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}, "epoch": 30}, path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _import_params(tmp_path: Path, path: Path, sha: str, arch: str = "mynets:small") -> Path:
    raw = tiny_params(tmp_path / "data" / "fmnist")
    raw["model"] = {"kind": "tcnn", "arch": arch, "code": "mynets.py"}  # the builder's file: a DVC dep
    raw["pretrain"]["source"] = {"weights": str(path), "sha256": sha, "mean": [0.3], "std": [0.35]}
    return write_params(tmp_path / "params.yaml", raw)


def _pretrain(cwd: Path, params: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.pretrain", "--params", str(params)], cwd=cwd,
                          env=stage_env(PYTHONPATH=repo_pythonpath()), capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("import-ws")
    write_dataset(ws / "data" / "fmnist", n_train=300, n_test=100)
    write_builder(ws)
    return ws


def test_the_pretrain_stage_imports_a_users_checkpoint(workspace: Path) -> None:
    path, sha = save_user_checkpoint(workspace)
    out = _pretrain(workspace, _import_params(workspace, path, sha))
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    from core.training.checkpoint import load

    metrics = json.loads((workspace / "runs/pretrain/metrics.json").read_text())
    assert metrics["imported"] and metrics["source"]["sha256"] == sha and metrics["epochs"] == 0
    assert metrics["normalization"] == {"mean": [0.3], "std": [0.35], "from": "pretrain.source"}
    assert not [n for n in metrics["notes"] if "trained at" in n]  # a builder names no input size
    stem, layer1, layer2, head = (
        1 * 8 * 9,
        2 * (8 * 8 * 9 + 16),
        8 * 16 * 9 + 16 * 16 * 9 + 2 * 32 + 8 * 16,
        170,
    )
    assert metrics["params_count"] == stem + layer1 + layer2 + head
    final = load(workspace / "runs/pretrain/cnn-final.pt")
    t1 = load(workspace / "runs/pretrain/ckpt/ckpt-epoch-000.pt")
    assert final["normalization"] == {"mean": [0.3], "std": [0.35]}
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(final["model"][k.removeprefix("module.")], v) for k, v in saved.items())
    assert all(torch.equal(t1["model"][k], v) for k, v in final["model"].items())
    # the builder's file is recorded (outside the project: by absolute path), for the stages that start from it
    builder = (workspace / "mynets.py").resolve()
    assert t1["network_code"] == {str(builder): hashlib.sha256(builder.read_bytes()).hexdigest()}
    # the accuracies it records are the imported network's own, on the normalised test split
    from core.data import load_split

    images, labels = load_split(workspace / "data" / "fmnist", "test")
    net = build_from_spec(final["model_spec"]).eval()
    net.load_state_dict(final["model"])
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.3) / 0.35
    acc = float((_logits(net, x).argmax(1) == torch.from_numpy(labels)).float().mean())
    assert metrics["test_acc"] == pytest.approx(acc, abs=1e-6)


def _refused(workspace: Path, params: Path, expected: str) -> None:
    import shutil

    shutil.rmtree(workspace / "runs", ignore_errors=True)
    out = _pretrain(workspace, params)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (workspace / "runs").exists()


def test_bad_imports_end_with_one_line_exit_2_and_nothing_written(workspace: Path) -> None:
    path, sha = save_user_checkpoint(workspace)
    _refused(workspace, _import_params(workspace, path, "1" * 64), f"sha256 {sha} does not match")
    cut = path.with_name("cut.pth")
    cut.write_bytes(path.read_bytes()[:200])
    cut_sha = hashlib.sha256(cut.read_bytes()).hexdigest()
    _refused(workspace, _import_params(workspace, cut, cut_sha), "cut.pth: not a readable checkpoint")
    _refused(workspace, _import_params(workspace, path, sha, "mynets:broken"),
             "mynets:broken returned str, not a torch nn.Module")  # fmt: skip
    other, other_sha = save_user_checkpoint(workspace, classes=10)
    state = torch.load(other, weights_only=True)
    state["state_dict"].pop("module.layer2.0.down.weight")
    torch.save(state, other)
    other_sha = hashlib.sha256(other.read_bytes()).hexdigest()
    _refused(
        workspace, _import_params(workspace, other, other_sha), "1 missing (first 'layer2.0.down.weight')"
    )


def test_a_sweep_shares_one_import_across_inits_and_seeds(tmp_path: Path, monkeypatch) -> None:
    from test_sweep import make_project

    from pipelines.sweep.plan import SweepError, make_plan

    path = make_project(tmp_path, {"seed": [0, 1], "reparam.alpha_init": [1.0, 50.0]})
    write_builder(tmp_path)
    weights, sha = save_user_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    source = {"weights": str(weights.relative_to(tmp_path)), "sha256": sha, "mean": [0.3], "std": [0.35]}
    base = validate_sweep_params(
        {
            **yaml.safe_load(path.read_text()),
            "model": {"kind": "tcnn", "arch": "mynets:small", "code": "mynets.py"},
        }
    )
    base = base.with_overrides({"pretrain.source": source})
    plan = make_plan(base, cwd=tmp_path)
    assert len(plan.trials) == 4 and len(plan.groups) == 1  # one import for both seeds and both inits
    (group,) = plan.groups.values()
    assert group.epochs == [0] and {t.params.t1() for t in plan.trials} == {0}
    assert {t.params.pretrain.source.weights for t in plan.trials} == {str(weights.resolve())}
    assert len(plan.controls) == 2  # one matched control per seed, shared by both inits
    other, other_sha = save_user_checkpoint(tmp_path, seed=3)
    moved = make_plan(base.with_overrides({"pretrain.source.sha256": other_sha}), cwd=tmp_path)
    assert set(moved.groups).isdisjoint(plan.groups)  # other weights: another import
    # model.code travels to the trials absolute (their working directory is not ours); an edit of the builder
    # is another import (its digest is part of the identity: a sweep runs without DVC)
    assert {t.params.model.code for t in plan.trials} == {(tmp_path / "mynets.py").resolve()}
    builder = tmp_path / "mynets.py"
    builder.write_text(builder.read_text() + "\n# edited\n")
    assert set(make_plan(base, cwd=tmp_path).groups).isdisjoint(plan.groups)
    with pytest.raises((ConfigError, SweepError), match="reparam.epoch: the CNN is imported"):
        make_plan(base.with_overrides({"sweep.grid.reparam.epoch": [0, 1]}), cwd=tmp_path)


def test_a_reparam_pattern_that_matches_no_conv_is_refused_before_any_run_opens(workspace: Path) -> None:
    """reparam.stages naming no conv of the imported net: one line listing the convs that could be chosen,
    exit 2, and neither an MLflow run (tracking on, in the workspace) nor a file written."""
    import shutil

    shutil.rmtree(workspace / "runs", ignore_errors=True)
    path, sha = save_user_checkpoint(workspace)
    params = _import_params(workspace, path, sha)
    assert _pretrain(workspace, params).returncode == 0
    before = sorted(p for p in workspace.rglob("*") if p.is_file())
    out = subprocess.run(
        [sys.executable, "-m", "stages.reparam", "--params", str(params), "-S", "reparam.stages=[nomatch.*]",
         "-S", "tracking.uri=sqlite:///mlruns.db"],
        cwd=workspace, env=stage_env(PYTHONPATH=repo_pythonpath(), TCNN_TRACKING="1"), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "matches 'nomatch.*'; its k x k convolutions, last first: layer2.0.conv2" in lines[0], lines[0]
    assert sorted(p for p in workspace.rglob("*") if p.is_file() and ".tcnn.lock" not in p.name) == [
        p for p in before if ".tcnn.lock" not in p.name
    ]
    assert not (workspace / "mlruns.db").exists()
