"""core.models.build: every kind, the project's small nets through timm's factory, clear errors."""

from __future__ import annotations

import pytest
import timm
import torch

from core.gpsa import GPSA
from core.models import PROJECT_ARCHS, build, is_known_arch
from core.reparam import gpsa_modules


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
    with pytest.raises(ValueError, match="kind 'psa'"):
        build("psa", "resnet10_cifar", 10)
    with pytest.raises(ValueError, match="convit_tiny"):
        build("convit", "resnet10_cifar", 10)
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("resnet10_cifar", pretrained=True)
