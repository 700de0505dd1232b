"""CMHSA ([Li21]): the convolution phase against a direct convolution, the Theorem 1 transfer (outputs equal to
<= 1e-4), gradients and training in both phases, and rebuilding from (arch, num_classes, options, phase)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.cmhsa import CMHSA, CMHSA_ARCHS, _wo_from_conv, build_cmhsa, mhsa_modules, patch_radius, to_mhsa

TOL = 1e-4


def _randomise_convs(model: CMHSA, std: float = 0.3) -> None:
    """Non-trivial conv-phase weights (default init is small and the bias is near zero)."""
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.conv.weight.normal_(0, std)
            blk.attn.conv.bias.normal_(0, std)


def _max_diff(a: CMHSA, b: CMHSA, x: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        feats = (a.forward_features(x) - b.forward_features(x)).abs().max().item()
        logits = (a(x) - b(x)).abs().max().item()
    return feats, logits


def test_conv_phase_is_a_pixel_convolution() -> None:
    """The conv-phase mixer equals F.conv2d on the image of pixels that the tokens hold ([Li21] Eq. 1), with the
    token layout written out by loops: token (gy, gx), index (u P + v) c + i = pixel (gy P + u, gx P + v),
    channel i."""
    torch.manual_seed(0)
    model = CMHSA(
        num_classes=3, img_size=(8, 12), in_chans=1, patch_size=4, pixel_dim=2, depth=1, kernel_size=5
    )
    mixer = model.blocks[0].attn
    p, c, (h, w) = 4, 2, model.grid_size
    tokens = torch.randn(2, h * w, p * p * c)
    img = torch.zeros(2, c, h * p, w * p)
    for gy in range(h):
        for gx in range(w):
            for u in range(p):
                for v in range(p):
                    img[:, :, gy * p + u, gx * p + v] = tokens[
                        :, gy * w + gx, (u * p + v) * c : (u * p + v + 1) * c
                    ]
    conv = F.conv2d(img, mixer.conv.weight, mixer.conv.bias, padding=2)
    expected = torch.empty_like(tokens)
    for gy in range(h):
        for gx in range(w):
            for u in range(p):
                for v in range(p):
                    expected[:, gy * w + gx, (u * p + v) * c : (u * p + v + 1) * c] = conv[
                        :, :, gy * p + u, gx * p + v
                    ]
    torch.testing.assert_close(mixer(tokens, (h, w)), expected)


def test_transfer_is_exact_fmnist() -> None:
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa_fmnist", 10, depth=2).eval()
    _randomise_convs(conv)
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    mhsa = to_mhsa(conv)
    assert mhsa.phase == "mhsa" and conv.phase == "conv" and not mhsa.training
    assert all(torch.equal(before[k], v) for k, v in conv.state_dict().items())  # input untouched
    x = torch.randn(4, 1, 28, 28)
    feats, logits = _max_diff(conv, mhsa, x)
    print(f"cmhsa_fmnist transfer at M=40: max |features diff| {feats:.2e}, max |logits diff| {logits:.2e}")
    assert feats <= TOL and logits <= TOL
    with torch.no_grad():
        assert conv.forward_features(x).abs().max() > 0.5  # the comparison is not between near-zero tensors
    # Sensitivity: a transposed kernel (the classic head <-> tap slip) is far from exact.
    flipped = to_mhsa(conv)
    with torch.no_grad():
        for blk_c, blk_m in zip(conv.blocks, flipped.blocks, strict=True):
            w_t = blk_c.attn.conv.weight.transpose(-1, -2)
            ref = nn.Conv2d(8, 8, 3, padding=1)
            ref.weight.copy_(w_t)
            ref.bias.copy_(blk_c.attn.conv.bias)
            blk_m.attn.proj.weight.copy_(_wo_from_conv(ref, 4, 1))
    assert _max_diff(conv, flipped, x)[0] > 100 * TOL


@pytest.mark.parametrize(
    "kernel, patch, img",
    [(3, 1, (7, 9)), (5, 1, (6, 8)), (3, 2, (10, 6)), (5, 2, (12, 10)), (7, 2, (8, 12)), (3, 3, (9, 12))],
)
def test_transfer_is_exact_any_kernel_and_patch(kernel: int, patch: int, img: tuple[int, int]) -> None:
    torch.manual_seed(kernel * 10 + patch)
    conv = CMHSA(
        num_classes=4, img_size=img, in_chans=2, patch_size=patch, pixel_dim=3, depth=2, kernel_size=kernel
    ).eval()
    _randomise_convs(conv)
    mhsa = to_mhsa(conv)
    r = math.ceil((kernel - 1) / (2 * patch))
    assert (
        mhsa.num_heads == (2 * r + 1) ** 2 == (2 * patch_radius(kernel, patch) + 1) ** 2
    )  # [Li21] Theorem 1
    if patch == 1:
        assert mhsa.num_heads == kernel**2  # Corollary 3 (pixel input)
    feats, logits = _max_diff(conv, mhsa, torch.randn(3, 2, *img))
    assert feats <= TOL and logits <= TOL


def test_exactness_depends_on_bias_init() -> None:
    """Lemma 2: off-target mass (N - 1) / (e^M + N - 1): small M is visibly inexact, the paper's 40 exact."""
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa_fmnist", 10, depth=1).eval()
    _randomise_convs(conv)
    x = torch.randn(2, 1, 28, 28)
    errs = {m: _max_diff(conv, to_mhsa(conv, bias_init=m), x)[0] for m in (4.0, 10.0, 20.0, 40.0)}
    print("max |features diff| by bias_init M:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert errs[4.0] > 1e-2  # M = 4 is clearly inexact
    assert errs[4.0] > errs[10.0] > errs[40.0]
    assert errs[20.0] <= TOL and errs[40.0] <= TOL
    with pytest.raises(ValueError, match="bias_init"):
        to_mhsa(conv, bias_init=0.0)


def test_attention_maps_after_transfer() -> None:
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa_fmnist", 10, depth=1).eval()
    mhsa = to_mhsa(conv)
    ((name, layer),) = mhsa_modules(mhsa)
    assert name == "blocks.0.attn"
    h, w = mhsa.grid_size
    tokens = torch.randn(2, h * w, mhsa.embed_dim)
    maps = layer.attention_maps(tokens)
    assert maps.shape == (2, 9, h * w, h * w)
    centre = (h // 2) * w + w // 2
    for r in range(9):
        a, b = divmod(r, 3)
        target = (h // 2 + a - 1) * w + (w // 2 + b - 1)
        assert maps[:, r, centre, target].min() > 1 - 1e-6  # head r reads the token at offset delta_r
    # a head pointing outside the grid puts its mass on the zero padding (like the conv's zero padding)
    assert maps[:, 0, 0].sum(-1).max() < 1e-6
    nl = layer.nonlocality(tokens)
    assert nl.shape == (9,) and nl[4] < 1e-6 and nl[0] > 0.5


def test_gradients_flow_through_mhsa_phase() -> None:
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa_fmnist", 10, depth=1)
    _randomise_convs(conv)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    for m, trainable_attention in ((40.0, False), (5.0, True)):
        model = to_mhsa(conv, bias_init=m)
        F.cross_entropy(model(x), y).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        dq = model.blocks[0].attn.qk_head_dim * model.num_heads
        for blk in model.blocks:
            assert blk.attn.proj.weight.grad.abs().sum() > 0
            assert blk.attn.qkv.weight.grad[2 * dq :].abs().sum() > 0  # W^V
            wq_grad = blk.attn.qkv.weight.grad[:dq].abs().sum()
            bias_grad = blk.attn.rel_bias.grad.abs().sum()
            if trainable_attention:  # W^Q gets a gradient because W^K is kept non-zero
                assert wq_grad > 1e-6 and bias_grad > 1e-6
        assert model.patch_embed.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("phase", ["conv", "mhsa"])
def test_training_steps_reduce_loss(phase: str) -> None:
    torch.manual_seed(0)
    model = build_cmhsa("cmhsa_fmnist", 10, depth=1, qk_head_dim=16)
    if phase == "mhsa":
        model = to_mhsa(model, bias_init=10.0)
    model.train()
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_rebuild_loads_state_dict_both_phases() -> None:
    opts = dict(depth=1, drop_path_rate=0.1, qk_head_dim=16)
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa_fmnist", 10, **opts).eval()
    _randomise_convs(conv)
    x = torch.randn(2, 1, 28, 28)
    torch.manual_seed(1)
    conv2 = build_cmhsa("cmhsa_fmnist", 10, **opts).eval()
    conv2.load_state_dict(conv.state_dict())
    mhsa = to_mhsa(conv)
    torch.manual_seed(2)
    mhsa2 = build_cmhsa("cmhsa_fmnist", 10, phase="mhsa", **opts).eval()
    with torch.no_grad():
        assert not torch.allclose(mhsa(x), mhsa2(x))
        mhsa2.load_state_dict(mhsa.state_dict())
        torch.testing.assert_close(conv2(x), conv(x), rtol=0, atol=0)
        torch.testing.assert_close(mhsa2(x), mhsa(x), rtol=0, atol=0)


def test_archs_and_errors() -> None:
    assert {"cmhsa_fmnist", "cmhsa_cifar", "cmhsa3_224", "cmhsa5_224"} <= set(CMHSA_ARCHS)
    model = build_cmhsa("cmhsa_cifar", 100)
    assert model.grid_size == (8, 8) and model(torch.randn(1, 3, 32, 32)).shape == (1, 100)
    with pytest.raises(ValueError, match="unknown arch"):
        build_cmhsa("cmhsa_huge", 10)
    with pytest.raises(ValueError, match="unknown option"):
        build_cmhsa("cmhsa_fmnist", 10, num_heads=4)
    with pytest.raises(ValueError, match="phase"):
        build_cmhsa("cmhsa_fmnist", 10, phase="attn")
    with pytest.raises(ValueError, match="to_mhsa"):
        to_mhsa(build_cmhsa("cmhsa_fmnist", 10, phase="mhsa"))


@pytest.mark.slow
def test_transfer_is_exact_paper_config() -> None:
    """[Li21] Table 1 setting (224 px, P = 16, d = 768, CMHSA-5: 9 heads), one layer to keep it light."""
    torch.manual_seed(0)
    conv = build_cmhsa("cmhsa5_224", 100, depth=1).eval()
    _randomise_convs(conv)
    mhsa = to_mhsa(conv)
    assert mhsa.num_heads == 9 and mhsa.embed_dim == 768
    feats, logits = _max_diff(conv, mhsa, torch.randn(2, 3, 224, 224))
    print(f"cmhsa5_224 (1 layer) transfer: max |features diff| {feats:.2e}, logits {logits:.2e}")
    assert feats <= TOL and logits <= TOL
