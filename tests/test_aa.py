"""Attention Augmented convolution and AA-ResNets ([Bello19]): parameter counts vs Table 6, relative logits vs a
brute-force Eq. 3, shapes for odd / non-square inputs and stride 2, rebuild from (arch, num_classes,
options)."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.models.aa_resnet import build_aa_resnet
from core.nn.aa import AAConv2d, aa_modules

TABLE6 = {0.25: 24.3, 0.5: 22.3, 0.75: 20.7, 1.0: 19.4}  # [Bello19] Table 6, AA-ResNet-50 params (M)


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.slow
def test_aa_resnet50_parameter_counts_match_table6() -> None:
    got = {}
    for ratio, paper in TABLE6.items():
        model = build_aa_resnet("resnet50", 1000, kappa=ratio, upsilon=ratio)
        got[ratio] = _n_params(model) / 1e6
        print(f"AA-ResNet-50 kappa=upsilon={ratio}: {got[ratio]:.2f} M ([Bello19] Table 6: {paper} M)")
        assert len(aa_modules(model)) == 4 + 6 + 3  # every block of the last three stages
        assert abs(got[ratio] - paper) <= 0.6
    assert got[0.25] > got[0.5] > got[0.75] > got[1.0]


@pytest.mark.slow
def test_aa_resnet50_forward_non_square() -> None:
    model = build_aa_resnet("resnet50", 7).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 67, 45)).shape == (1, 7)


def test_parameter_delta_matches_hand_count() -> None:
    """Exact count per augmented layer ([Bello19] Sec. 3.2 / Eq. 5 with biases and the relative tables)."""
    base = timm.create_model("resnet10_cifar", num_classes=10, in_chans=1)
    model = build_aa_resnet(
        "resnet10_cifar", 10, in_chans=1, img_size=28, kappa=0.5, upsilon=0.25, num_heads=4
    )
    expected = 0
    # (F_in, F_out, attention grid) of conv1 of layer2..4 for a 28 px input: 14x14, 7x7, 4x4 (stride-2 convs)
    for f_in, f_out, hw in ((16, 32, 14), (32, 64, 7), (64, 128, 4)):
        dk, dv, nh = f_out // 2, f_out // 4, 4
        expected += -f_in * dv * 9  # conv filters replaced by attention maps
        expected += f_in * (2 * dk + dv) + (2 * dk + dv)  # qkv 1x1 conv + bias
        expected += dv * dv + dv  # head-mixing 1x1 conv + bias
        expected += (2 * (hw + hw) - 2) * (dk // nh)  # r^H, r^W ([Bello19] Sec. 3.1.1)
    assert _n_params(model) - _n_params(base) == expected


def _brute_logits(layer: AAConv2d, q: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[Bello19] Eq. 3 position terms by loops: q_i . (r^W[j_x - i_x] + r^H[j_y - i_y]), clipped to the table."""
    th, tw = (layer.rel_height.shape[0] + 1) // 2, (layer.rel_width.shape[0] + 1) // 2
    out = torch.zeros(q.shape[0], q.shape[1], h * w, h * w, dtype=q.dtype)
    for i in range(h * w):
        iy, ix = divmod(i, w)
        for j in range(h * w):
            jy, jx = divmod(j, w)
            dy = max(-(th - 1), min(th - 1, jy - iy)) + th - 1
            dx = max(-(tw - 1), min(tw - 1, jx - ix)) + tw - 1
            out[:, :, i, j] = q[:, :, i] @ (layer.rel_width[dx] + layer.rel_height[dy])
    return out


@pytest.mark.parametrize("size", [(3, 4), (2, 3), (5, 6), (4, 1)])
def test_relative_logits_match_brute_force(size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    layer = AAConv2d(6, 8, kappa=0.5, upsilon=0.5, num_heads=2, feat_size=(3, 4)).double()
    h, w = size
    q = torch.randn(2, 2, h * w, layer.dkh, dtype=torch.float64)
    torch.testing.assert_close(layer.relative_logits(q, h, w), _brute_logits(layer, q, h, w))


def test_aa_conv_forward_matches_direct_computation() -> None:
    """Whole layer vs a direct implementation of [Bello19] Eq. 2-4 and the concat of Sec. 3.2 (stride 1, 4x5)."""
    torch.manual_seed(1)
    layer = AAConv2d(5, 12, kappa=0.5, upsilon=0.5, num_heads=2, feat_size=(4, 5)).double()
    x = torch.randn(2, 5, 4, 5, dtype=torch.float64)
    b, h, w, nh = 2, 4, 5, 2
    qkv = F.conv2d(x, layer.qkv.weight, layer.qkv.bias).flatten(2)  # [B, 2dk+dv, L]
    k, q, v = qkv.split([layer.dk, layer.dk, layer.dv], dim=1)
    heads = []
    for hd in range(nh):
        qh = q[:, hd * layer.dkh : (hd + 1) * layer.dkh].transpose(1, 2)  # [B, L, dkh]
        kh = k[:, hd * layer.dkh : (hd + 1) * layer.dkh].transpose(1, 2)
        vh = v[:, hd * layer.dvh : (hd + 1) * layer.dvh].transpose(1, 2)
        logits = torch.empty(b, h * w, h * w, dtype=x.dtype)
        for i in range(h * w):
            for j in range(h * w):
                (iy, ix), (jy, jx) = divmod(i, w), divmod(j, w)
                r = layer.rel_width[jx - ix + w - 1] + layer.rel_height[jy - iy + h - 1]
                logits[:, i, j] = (qh[:, i] * (kh[:, j] + r)).sum(-1) / layer.dkh**0.5
        heads.append(logits.softmax(-1) @ vh)
    mha = torch.cat(heads, dim=-1).transpose(1, 2).reshape(b, layer.dv, h, w)
    expected = torch.cat([layer.conv(x), F.conv2d(mha, layer.proj.weight, layer.proj.bias)], dim=1)
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("hw", [(29, 37), (33, 33), (8, 5), (1, 2)])
@pytest.mark.parametrize("downsample", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_aa_conv_shapes_match_conv(hw: tuple[int, int], downsample: bool, stride: int) -> None:
    layer = AAConv2d(
        8, 16, 3, stride, kappa=0.25, upsilon=0.5, num_heads=4, feat_size=(7, 9), downsample=downsample
    )
    ref = nn.Conv2d(8, 16, 3, stride, 1)
    x = torch.randn(2, 8, *hw)
    y = layer(x)
    assert y.shape == ref(x).shape
    assert torch.isfinite(y).all()


def test_aa_resnet_small_odd_sizes_and_stride() -> None:
    model = build_aa_resnet("resnet10_cifar", 10, in_chans=1, img_size=28, num_heads=4).eval()
    names = [n for n, _ in aa_modules(model)]
    assert names == ["layer2.0.conv1", "layer3.0.conv1", "layer4.0.conv1"]
    assert all(m.stride == 2 and not m.downsample for _, m in aa_modules(model))
    with torch.no_grad():
        for hw in ((28, 28), (29, 37), (33, 33), (9, 13)):
            assert model(torch.randn(2, 1, *hw)).shape == (2, 10)


def test_fully_attentional_layer() -> None:
    layer = AAConv2d(8, 16, 3, 2, kappa=1.0, upsilon=1.0, num_heads=4, feat_size=(4, 4))
    assert layer.conv is None and layer.dv == 16
    assert layer(torch.randn(1, 8, 7, 9)).shape == (1, 16, 4, 5)


@pytest.mark.parametrize(
    "opts, word",
    [
        (dict(kappa=0.0), "kappa"),
        (dict(kappa=1.5), "kappa"),
        (dict(upsilon=0.0), "upsilon"),
        (dict(upsilon=-0.25), "upsilon"),
        (dict(upsilon=2.0), "upsilon"),
        (dict(num_heads=0), "num_heads"),
    ],
)
def test_ratio_validation(opts: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        build_aa_resnet("resnet10_cifar", 10, **opts)


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_aa_resnet("no_such_net", 10)


def test_rebuild_loads_state_dict() -> None:
    opts = dict(in_chans=1, img_size=28, kappa=0.25, upsilon=0.5, num_heads=2)
    torch.manual_seed(0)
    a = build_aa_resnet("resnet10_cifar", 10, **opts).eval()
    torch.manual_seed(1)
    b = build_aa_resnet("resnet10_cifar", 10, **opts).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert not torch.allclose(a(x), b(x))
        b.load_state_dict(a.state_dict())
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_training_step_updates_attention() -> None:
    torch.manual_seed(0)
    # timm zero-inits each block's last BN, which would cut every gradient into the residual branch
    model = build_aa_resnet("resnet10_cifar", 10, in_chans=1, img_size=28, num_heads=2, zero_init_last=False)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, layer in aa_modules(model):
        for pname, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}.{pname}"
            assert p.grad.abs().sum() > 0, f"{name}.{pname}"
