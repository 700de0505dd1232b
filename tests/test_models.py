"""core.models.build: every kind, the project's small nets through timm's factory, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

from core.models.factory import build, is_known_arch
from core.models.resnets import PROJECT_ARCHS
from core.nn.gpsa import GPSA
from core.reparam import gpsa_modules

REPO = Path(__file__).resolve().parents[1]


def test_cnn_small_nets_via_timm_factory() -> None:
    for arch in PROJECT_ARCHS:
        assert is_known_arch(arch) and timm.is_model(arch)
    m = build("cnn", "resnet10_cifar", 10, in_chans=1)
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    feats = m.forward_features(torch.randn(1, 1, 28, 28))
    assert feats.shape[-2:] == (4, 4)  # CIFAR stem: last stage at 4x4 for 28 px
    m2 = timm.create_model("resnet18_cifar", num_classes=5, drop_path_rate=0.1)
    assert m2(torch.randn(1, 3, 32, 32)).shape == (1, 5)
    m3 = build("cnn", "resnet10_cifar", 10, in_chans=1, drop_path=0.2)  # params.yaml's model.drop_path
    assert any(type(x).__name__ == "DropPath" for x in m3.modules())


def test_tcnn_kind_passes_reparam_options() -> None:
    m = build("tcnn", "resnet10_cifar", 10, in_chans=1, alpha_init=2.0, lambda_init=3.0, stride_mode="s1")
    mods = gpsa_modules(m)
    assert [n for n, _ in mods] == ["layer4.0.conv1", "layer4.0.conv2"]
    g = mods[0][1]
    assert isinstance(g, GPSA) and g.stride_mode == "s1"
    torch.testing.assert_close(g.alpha(), torch.full((9,), 2.0))
    torch.testing.assert_close(g.gating_param, torch.full((9,), 3.0), check_device=False)
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_convit_kind() -> None:
    m = build("convit", "convit_tiny", 10, img_size=28, patch_size=4, in_chans=1)
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert sum(isinstance(x, GPSA) for x in m.modules()) == 10


def test_errors() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build("cnn", "resnet_nope", 10)
    with pytest.raises(ValueError, match="unknown model kind 'vit'"):
        build("vit", "resnet10_cifar", 10)
    with pytest.raises(ValueError, match="options.gating: applies to kinds"):
        build("psa", "resnet10_cifar", 10, gating="freeze0")
    with pytest.raises(ValueError, match="convit_tiny"):
        build("convit", "resnet10_cifar", 10)
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("resnet10_cifar", pretrained=True)


SPECS = [  # kind, arch, options, conversion section, phase
    ("cnn", "resnet10_cifar", {}, None, None),
    ("tcnn", "resnet10_cifar", {"gating": "freeze0"},
     {"alpha_init": 2.0, "lambda_init": 0.5, "stages": [-1], "stride_mode": "s1"}, None),
    ("psa", "resnet10_cifar", {"qk_init": "random"},
     {"alpha_init": 3.0, "lambda_init": 1.0, "stages": [-2, -1], "stride_mode": "exact"}, None),
    ("hybrid_scratch", "resnet10_cifar", {},
     {"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1], "stride_mode": "exact"}, None),
    ("convit", "convit_fmnist", {"conv_init": False, "freeze_gpsa": True}, None, None),
    ("aa_resnet", "resnet10_cifar", {"img_size": 28, "kappa": 0.5, "upsilon": 0.5}, None, None),
    ("cmhsa", "cmhsa_fmnist", {}, None, "conv"),
    ("cmhsa", "cmhsa_fmnist", {}, None, "mhsa"),
]  # fmt: skip


@pytest.mark.parametrize("kind,arch,options,conv,phase", SPECS)
def test_every_kind_rebuilds_from_its_spec(kind, arch, options, conv, phase) -> None:
    """make_model_spec -> build_from_spec (another random init) + load_state_dict: identical logits and the
    same frozen parameters; the conversion section and the phase decide what is built."""
    from core.models.spec import build_from_spec, make_model_spec
    from core.nn.psa import PSA

    spec = make_model_spec(kind, arch, 10, 1, options, conv, phase=phase)
    torch.manual_seed(0)
    a = build_from_spec(spec).eval()
    torch.manual_seed(1)
    b = build_from_spec(spec).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert [n for n, p in a.named_parameters() if not p.requires_grad] == [
        n for n, p in b.named_parameters() if not p.requires_grad
    ]
    layers = gpsa_modules(a)
    if conv is not None:
        assert spec["tcnn"]["attention"] == ("psa" if kind == "psa" else "gpsa")
        assert layers and all(isinstance(g, PSA if kind == "psa" else GPSA) for _, g in layers)
        assert all(g.stride_mode == conv["stride_mode"] for _, g in layers)
        torch.testing.assert_close(layers[0][1].alpha().detach(), torch.full((9,), conv["alpha_init"]))
    if kind == "cmhsa":
        assert a.phase == phase and spec["phase"] == phase
    if kind == "cnn":
        assert not layers and "phase" not in spec


def test_spec_errors() -> None:
    from core.models.spec import build_from_spec, make_model_spec

    conv = {"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1], "stride_mode": "exact", "attention": "psa"}
    with pytest.raises(ValueError, match="does not fit kind 'tcnn'"):
        make_model_spec("tcnn", "resnet10_cifar", 10, 1, {}, conv)
    with pytest.raises(ValueError, match="phase applies to two-phase kinds only"):
        make_model_spec("cnn", "resnet10_cifar", 10, 1, {}, phase="conv")
    # an old T-CNN spec (kind "tcnn", section without "attention") still rebuilds a GPSA model
    old = {"kind": "tcnn", "arch": "resnet10_cifar", "num_classes": 10, "in_chans": 1, "options": {},
           "tcnn": {"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1], "stride_mode": "exact"}}  # fmt: skip
    assert all(isinstance(g, GPSA) for _, g in gpsa_modules(build_from_spec(old)))


def test_default_model_gpsa_layers_see_at_least_7x7_maps() -> None:
    """At the default resolution the default network's GPSA layers work on maps of 7x7 or more (the paper's
    last stage is 7x7 at 224 px); checked on the layers' real inputs with forward hooks."""
    from core.config import load_params
    from core.models.factory import build
    from core.reparam import gpsa_modules, to_tcnn

    p = load_params(REPO / "params.yaml")
    cnn = build("cnn", p.model.arch, 10, in_chans=1)
    tcnn = to_tcnn(cnn, stages=tuple(p.reparam.stages)).eval()
    seen = {}
    layers = gpsa_modules(tcnn)
    assert len(layers) == 2

    def hook(name: str):
        def record(mod, args, out) -> None:  # returns None: the layer's output is left alone
            seen[name] = (args[0].shape, out.shape)

        return record

    for name, m in layers:
        m.register_forward_hook(hook(name))
    with torch.no_grad():
        tcnn(torch.zeros(2, 1, p.data.image_size, p.data.image_size))
    for name, (inp, out) in seen.items():
        assert min(inp[-2:]) >= 7 and min(out[-2:]) >= 7, (name, inp, out)
