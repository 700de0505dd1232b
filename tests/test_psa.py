"""PSA (core.nn.psa): exact convolutional init ([Cordonnier20] Lemma 1), the formula against a direct reference, gradients."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_reparam import _max_logit_diff, _nontrivial_bn

import core.models.resnets  # noqa: F401  (registers the project's small nets in timm)
from core.nn.psa import PSA
from core.reparam import gpsa_modules, to_tcnn

CASES = [
    pytest.param("resnet10_cifar", 1, [(28, 28), (27, 21)], id="resnet10_cifar"),
    pytest.param("resnet18", 3, [(48, 48), (67, 45)], id="resnet18"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,in_chans,sizes", CASES)
def test_psa_conversion_is_exact_at_large_alpha(arch: str, in_chans: int, sizes: list) -> None:
    """[Cordonnier20] Eq. 5: centres on the taps, W_val = I, zero content logits -> at alpha = 50 the logits equal the
    CNN's (<= 1e-4) at any resolution, the strided conv and the zero-padded borders included."""
    torch.manual_seed(0)
    cnn = _nontrivial_bn(timm.create_model(arch, num_classes=10, in_chans=in_chans), in_chans, sizes[0])
    before = copy.deepcopy(cnn.state_dict())
    psa = to_tcnn(cnn, attention="psa", alpha_init=50.0).eval()
    assert all(torch.equal(before[k], v) for k, v in cnn.state_dict().items())  # input untouched
    layers = gpsa_modules(psa)
    assert [n for n, _ in layers] == [n for n, _ in gpsa_modules(to_tcnn(cnn))]
    assert all(isinstance(m, PSA) for _, m in layers) and any(m.stride == 2 for _, m in layers)
    for name, m in layers:
        assert torch.equal(m.weight, cnn.get_submodule(name).weight)  # the filter is the PSA's `weight`
    for hw in sizes:
        x = torch.randn(2, in_chans, *hw)
        err, scale = _max_logit_diff(cnn, psa, x)
        assert scale > 0.05
        assert err <= 1e-4, f"{arch} at {hw}: max |logit diff| = {err:.2e}"
    # not function-preserving: the paper's alpha = 1, and the BoTNet-style stride
    err1, _ = _max_logit_diff(
        cnn, to_tcnn(cnn, attention="psa", alpha_init=1.0), torch.randn(2, in_chans, *sizes[1])
    )
    err_s1, _ = _max_logit_diff(
        cnn,
        to_tcnn(cnn, attention="psa", alpha_init=50.0, stride_mode="s1"),
        torch.randn(2, in_chans, *sizes[1]),
    )
    assert min(err1, err_s1) > 1e-2


def _reference(m: PSA, x: torch.Tensor) -> torch.Tensor:
    """[ConViT21] Eq. 4 with the quadratic encoding, written out independently: loops over heads and queries, the
    conv's zero padding as explicit zero pixels, stride-1 attention subsampled [::s, ::s]."""
    b, c, h, w = x.shape
    p, k, nh, dq = m.padding, m.kernel_size, m.num_heads, m.qk_head_dim
    xp = F.pad(x, (p, p, p, p)).double()
    wq, wk, wv = m.qkv_weight.detach().double().split([nh * dq, nh * dq, c])
    out = torch.zeros(b, m.out_dim, h, w, dtype=torch.float64)
    alpha, centres = m.alpha().detach().double(), m.centers().detach().double()
    kr = torch.arange(-p, h + p, dtype=torch.float64).repeat_interleave(w + 2 * p)  # key rows, row-major
    kc = torch.arange(-p, w + p, dtype=torch.float64).repeat(h + 2 * p)
    tokens = xp.permute(0, 2, 3, 1).reshape(b, -1, c)
    keys = [tokens @ wk[hd * dq : (hd + 1) * dq].T for hd in range(nh)]  # [B, L, dq] per head
    values = tokens @ wv.T  # [B, L, C], shared by the heads
    filt = m.weight.detach().double()
    for i in range(h):
        for j in range(w):
            xi = x[:, :, i, j].double()
            for hd in range(nh):
                q = xi @ wq[hd * dq : (hd + 1) * dq].T  # [B, dq]
                pos = -alpha[hd] * ((kr - i - centres[hd, 0]) ** 2 + (kc - j - centres[hd, 1]) ** 2)
                a = ((keys[hd] @ q[:, :, None])[..., 0] / dq**0.5 + pos).softmax(-1)  # [B, L]
                y = (a[:, :, None] * values).sum(1)  # [B, C]
                out[:, :, i, j] += y @ filt[:, :, hd // k, hd % k].T
    if m.bias is not None:
        out += m.bias.double()[None, :, None, None]
    return out[:, :, :: m.stride, :: m.stride]


@pytest.mark.parametrize("stride,hw", [(1, (5, 4)), pytest.param(2, (5, 6), marks=pytest.mark.slow)])
def test_forward_equals_the_formula(stride: int, hw: tuple[int, int]) -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(6, 5, 3, stride=stride, padding=1, bias=True)
    m = PSA.from_conv(conv, alpha_init=0.7, qk_init="random")
    with torch.no_grad():  # content logits of order 1 and off-grid centres: both terms matter
        m.qkv_weight.mul_(20)
        m.pos_center.add_(torch.randn(9, 2) * 0.3)
    x = torch.randn(2, 6, *hw)
    got = m(x).double()
    ref = _reference(m, x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the mixed attention really has a content part: content-only and positional-only maps differ from it
    a = m.attention_maps(x)
    assert (a - m.attention_maps(x, part="positional")).abs().max() > 1e-2
    assert (a - m.attention_maps(x, part="content")).abs().max() > 1e-2


def test_attention_maps_sit_on_the_taps_and_drop_padded_keys() -> None:
    m = PSA(4, 4, alpha_init=50.0)
    a = m.attention_maps(torch.randn(1, 4, 5, 5))[0]  # [9, 25, 25]
    q = 2 * 5 + 2  # interior query (2, 2)
    for hd in range(9):
        r, c = 2 + hd // 3 - 1, 2 + hd % 3 - 1
        assert a[hd, q].argmax().item() == r * 5 + c and a[hd, q, r * 5 + c] > 1 - 1e-6
    # corner query (0, 0): head 0 looks at (-1, -1), a padded zero pixel -> no mass on real keys
    assert a[0, 0].sum() < 1e-6 and a[4, 0].sum() > 1 - 1e-6


def test_gradients_reach_content_projections_and_alpha() -> None:
    """qk_init="zero_key": content logits 0 (exact init) yet W_key gets a gradient at once, W_qry after one
    step; alpha and the centres get one too. qk_init="zero" ([Cordonnier20] Eq. 5 literally) is a saddle: none."""
    torch.manual_seed(2)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    x, target = torch.randn(4, 8, 6, 6), torch.randn(4, 8, 6, 6)
    m = PSA.from_conv(conv, alpha_init=1.0)
    nh, dq = m.num_heads, m.qk_head_dim
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    F.mse_loss(m(x), target).backward()
    g = m.qkv_weight.grad
    assert g[: nh * dq].abs().max() == 0  # dL/dW_qry = 0 while W_key = 0 ...
    assert g[nh * dq : 2 * nh * dq].abs().max() > 0  # ... but W_key moves
    assert m.pos_alpha.grad.abs().max() > 0 and m.pos_center.grad.abs().max() > 0
    opt.step()
    opt.zero_grad()
    F.mse_loss(m(x), target).backward()
    assert m.qkv_weight.grad[: nh * dq].abs().max() > 0  # W_qry trains from the second step on

    z = PSA.from_conv(conv, alpha_init=1.0, qk_init="zero")
    F.mse_loss(z(x), target).backward()
    assert z.qkv_weight.grad[: 2 * nh * dq].abs().max() == 0


def test_psa_model_kind_and_optimizer_groups() -> None:
    from core.models.factory import build
    from core.training.optim import param_groups

    m = build("psa", "resnet10_cifar", 10, in_chans=1, alpha_init=3.0, stride_mode="s1")
    layers = gpsa_modules(m)
    assert all(isinstance(g, PSA) and g.stride_mode == "s1" for _, g in layers)
    torch.testing.assert_close(layers[0][1].alpha(), torch.full((9,), 3.0), rtol=1e-6, atol=1e-6)
    groups = {
        g["name"]: {id(p) for p in g["params"]}
        for g in param_groups(m, lr=1.0, weight_decay=0.1, gate_lr=0.1)
    }
    for _, g in layers:  # no weight decay on alpha and the centres; no gate group (PSA has no gate)
        assert id(g.pos_alpha) in groups["no_decay"] and id(g.pos_center) in groups["no_decay"]
        assert id(g.qkv_weight) in groups["decay"]
    assert "gate" not in groups
    with pytest.raises(ValueError, match="lambda"):
        build("psa", "resnet10_cifar", 10, lambda_init=1.0)
