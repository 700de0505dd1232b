"""The ConViT GPSA and the project's ConViT against timm's implementation (outputs and gradients)."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.convit import GPSA as TimmGPSA

from core.models.convit import ConViT
from core.models.factory import build
from core.nn.gpsa import ALPHA_BETA
from core.nn.gpsa_convit import ConvitGPSA


def _random_timm_gpsa(dim: int, heads: int, seed: int) -> TimmGPSA:
    torch.manual_seed(seed)
    t = TimmGPSA(dim, num_heads=heads)
    t.local_init()
    with torch.no_grad():
        for lin in (t.qk, t.v, t.proj):
            lin.weight.normal_(0.0, 0.3)
        t.proj.bias.normal_()
        t.gating_param.normal_(0.0, 1.5)  # random gates: both branches matter
        t.pos_proj.weight.add_(0.3 * torch.randn_like(t.pos_proj.weight))
        t.pos_proj.weight[:, 2].abs_().neg_().sub_(0.05)  # keep alpha = -w[:, 2] > 0
        t.pos_proj.bias.normal_()  # cancels in the softmax
    return t


def _expected_positional_grads(t: TimmGPSA, ours: ConvitGPSA) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rule from timm's pos_proj gradient to (alpha~, Delta).

    timm's score: w_x dx + w_y dy + w_d2 |d|^2 (+ b). Ours: -alpha |d - Delta|^2 = w_d2 |d|^2 + w_y dy + w_x dx
    + const with w_d2 = -alpha, w_y = 2 alpha Delta_y, w_x = 2 alpha Delta_x, alpha = softplus(alpha~) + eps.
    """
    gw = t.pos_proj.weight.grad.double()  # [heads, 3] on (dx, dy, d2)
    alpha = ours.alpha().detach().double()
    cy, cx = ours.pos_center.detach().double().unbind(1)
    dalpha = -gw[:, 2] + 2 * cy * gw[:, 1] + 2 * cx * gw[:, 0]
    d_raw = dalpha * torch.sigmoid(ALPHA_BETA * ours.pos_alpha.detach().double())
    d_center = torch.stack([2 * alpha * gw[:, 1], 2 * alpha * gw[:, 0]], 1)
    return d_raw, d_center


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-5) -> None:
    """float32 agreement relative to the tensor's scale."""
    scale = max(b.abs().max().item(), 1e-12)
    torch.testing.assert_close(a.double(), b.double(), rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("dim,heads,grid", [(36, 9, (6, 6)), (48, 4, (5, 5))])
@pytest.mark.parametrize("impl", ["sdpa", "dense"])
def test_gpsa_matches_timm_outputs_and_gradients(dim: int, heads: int, grid: tuple, impl: str) -> None:
    t = _random_timm_gpsa(dim, heads, seed=0)
    ours = ConvitGPSA(dim, num_heads=heads, attn_impl=impl)
    ours.load_state_dict(t.state_dict())
    n = grid[0] * grid[1]
    x1 = torch.randn(3, n, dim, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    r = torch.randn(3, n, dim)
    y1, y2 = t(x1), ours(x2)
    _close(y2, y1)
    (y1 * r).sum().backward()
    (y2 * r).sum().backward()
    _close(x2.grad, x1.grad)
    _close(ours.qkv_weight.grad, torch.cat([t.qk.weight.grad, t.v.weight.grad]))
    _close(ours.weight.grad, t.proj.weight.grad)
    _close(ours.bias.grad, t.proj.bias.grad)
    _close(ours.gating_param.grad, t.gating_param.grad)
    d_raw, d_center = _expected_positional_grads(t, ours)
    _close(ours.pos_alpha.grad, d_raw, rel=1e-4)
    _close(ours.pos_center.grad, d_center, rel=1e-4)
    assert t.pos_proj.bias.grad.abs().max() < 1e-5 * t.pos_proj.weight.grad.abs().max()  # it cancels


def test_linear_positional_grads_equal_timm_pos_proj() -> None:
    t = _random_timm_gpsa(36, 9, seed=1)
    ours = ConvitGPSA(36, num_heads=9, positional="linear")
    ours.load_state_dict(t.state_dict())
    x = torch.randn(2, 36, 36)
    r = torch.randn(2, 36, 36)
    (t(x) * r).sum().backward()
    (ours(x) * r).sum().backward()
    gw = t.pos_proj.weight.grad
    _close(ours.pos_weight.grad, torch.stack([gw[:, 2], gw[:, 1], gw[:, 0]], 1))


def test_nonlocality_matches_timm_attention_map_distance() -> None:
    t = _random_timm_gpsa(36, 9, seed=2)
    ours = ConvitGPSA(36, num_heads=9)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(4, 49, 36)
    with torch.no_grad():
        t(x)  # timm builds its rel_indices lazily in forward; get_attention_map needs them
        dist, amap = t.get_attention_map(x, return_map=True)
        _close(ours.nonlocality(x), dist)
        _close(ours.attention_maps(x).mean(0), amap)


def test_anti_local_heads_need_the_linear_parameterisation() -> None:
    t = _random_timm_gpsa(36, 9, seed=3)
    with torch.no_grad():
        t.pos_proj.weight[4, 2] = 0.2  # alpha = -0.2: an anti-local head
    with pytest.raises(ValueError, match="positional='linear'"):
        ConvitGPSA(36, num_heads=9).load_state_dict(t.state_dict())
    ours = ConvitGPSA(36, num_heads=9, positional="linear")
    ours.load_state_dict(t.state_dict())
    x = torch.randn(2, 36, 36)
    with torch.no_grad():
        _close(ours(x), t(x))


def _timm_convit(arch: str, seed: int, **kw: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = timm.create_model(arch, num_classes=10, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("gating_param"):
                p.normal_(0.0, 1.5)
            elif name.endswith("pos_proj.weight"):
                p.add_(0.2 * torch.randn_like(p))
                p[:, 2].abs_().neg_().sub_(0.05)
    return m.eval()


def test_project_convit_loads_timm_and_matches_logits_and_gradients() -> None:
    kw = dict(img_size=32, patch_size=4, drop_path_rate=0.0)
    ref = _timm_convit("convit_tiny", seed=0, **kw)
    ours = build("convit", "convit_tiny", 10, **kw).eval()
    assert isinstance(ours, ConViT)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x1 = torch.randn(3, 3, 32, 32, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    _close(y2, y1)
    r = torch.randn_like(y1)
    (y1 * r).sum().backward()
    (y2 * r).sum().backward()
    _close(x2.grad, x1.grad)
    ref_params = dict(ref.named_parameters())
    shared = 0
    for name, p in ours.named_parameters():
        if name in ref_params:  # everything outside the GPSA layers, plus gating_param, keeps its name
            _close(p.grad, ref_params[name].grad, rel=1e-4)
            shared += 1
    assert shared > 100
    for i, blk in enumerate(ours.blocks[: ours.local_up_to_layer]):
        tblk = ref.blocks[i].attn
        _close(blk.attn.qkv_weight.grad, torch.cat([tblk.qk.weight.grad, tblk.v.weight.grad]), rel=1e-4)
        _close(blk.attn.weight.grad, tblk.proj.weight.grad, rel=1e-4)
        d_raw, d_center = _expected_positional_grads(tblk, blk.attn)
        _close(blk.attn.pos_alpha.grad, d_raw, rel=1e-3)
        _close(blk.attn.pos_center.grad, d_center, rel=1e-3)


def test_project_convit_init_equals_timm_init() -> None:
    torch.manual_seed(5)
    ref = timm.create_model("convit_tiny", num_classes=10, img_size=32, patch_size=4).eval()
    torch.manual_seed(5)
    ours = build("convit", "convit_tiny", 10, img_size=32, patch_size=4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _close(ours(x), ref(x))
    g = ours.blocks[0].attn
    torch.testing.assert_close(g.alpha(), torch.ones(4))  # locality_strength 1 ([ConViT21] Sec. 3)
    assert sorted(map(tuple, g.centers().tolist())) == [(-0.5, -0.5), (-0.5, 0.5), (0.5, -0.5), (0.5, 0.5)]


def test_project_convit_small_grayscale_and_non_square() -> None:
    m = build("convit", "convit_tiny", 10, img_size=(28, 20), patch_size=4, in_chans=1, drop_path=0.1)
    y = m(torch.randn(2, 1, 28, 20))
    assert y.shape == (2, 10)
    assert m.blocks[0].attn.grid_size == (7, 5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["convit_small", "convit_base"])
def test_bigger_configs_load_timm_weights(arch: str) -> None:
    kw = dict(img_size=48, patch_size=16)
    ref = _timm_convit(arch, seed=0, **kw)
    ours = build("convit", arch, 10, **kw).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        _close(ours(x), ref(x), rel=1e-4)
