"""core.models.he_cifar: the CIFAR-10 ResNets of He et al. 2016, Sec. 4.2 (option-A shortcuts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from core.models.he_cifar import (
    BasicBlock,
    OptionAShortcut,
    cifar_resnet,
    resnet20,
    resnet32,
    resnet44,
    resnet56,
)


@pytest.mark.parametrize(
    ("builder", "millions"), [(resnet20, 0.27), (resnet32, 0.46), (resnet44, 0.66), (resnet56, 0.85)]
)
def test_parameter_counts_match_table_6(builder, millions: float) -> None:
    n_params = sum(p.numel() for p in builder().parameters())
    assert round(n_params / 1e6, 2) == millions


def test_generic_builder_depths() -> None:
    assert cifar_resnet(20).depth == 20
    assert len(cifar_resnet(56).layer2) == 9
    with pytest.raises(ValueError):
        cifar_resnet(21)


def test_output_shape() -> None:
    model = resnet20().eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert resnet20(num_classes=7).linear.out_features == 7


def test_option_a_shortcut_by_hand() -> None:
    block = BasicBlock(2, 4, stride=2)
    assert isinstance(block.shortcut, OptionAShortcut)
    assert list(block.shortcut.parameters()) == []
    x = torch.arange(2 * 2 * 4 * 4, dtype=torch.float32).reshape(2, 2, 4, 4)
    expected = torch.zeros(2, 4, 2, 2)  # planes // 4 = 1 zero channel on each side
    expected[:, 1:3] = x[:, :, ::2, ::2]
    torch.testing.assert_close(block.shortcut(x), expected, rtol=0, atol=0)
    # 16 -> 32 in the full net: 8 zero channels on each side.
    sc = resnet20().layer2[0].shortcut
    x = torch.randn(1, 16, 8, 8)
    out = sc(x)
    assert out.shape == (1, 32, 4, 4)
    torch.testing.assert_close(out[:, 8:24], x[:, :, ::2, ::2], rtol=0, atol=0)
    assert out[:, :8].abs().sum() == 0 and out[:, 24:].abs().sum() == 0


def test_state_dict_keys() -> None:
    model = resnet20()
    keys = set(model.state_dict())
    assert not any("shortcut" in k for k in keys)
    assert {"conv1.weight", "bn1.running_var", "layer1.0.conv1.weight", "layer3.2.bn2.bias"} <= keys
    assert {"linear.weight", "linear.bias"} <= keys
    assert all(k.split(".")[0] in {"conv1", "bn1", "layer1", "layer2", "layer3", "linear"} for k in keys)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19 and all(type(m) is nn.Conv2d and m.kernel_size == (3, 3) for m in convs)
    assert all(m.bias is None for m in convs)


def test_stage_resolutions() -> None:
    model = resnet20().eval()
    sizes: dict[str, tuple[int, int, int]] = {}
    handles = [
        getattr(model, name).register_forward_hook(
            lambda _m, _i, out, name=name: sizes.__setitem__(name, tuple(out.shape[1:]))
        )
        for name in ("layer1", "layer2", "layer3")
    ]
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    for h in handles:
        h.remove()
    assert sizes == {"layer1": (16, 32, 32), "layer2": (32, 16, 16), "layer3": (64, 8, 8)}
