"""GPSA layer (core.nn.gpsa): against the paper's formula written out naively, a direct conv, finite differences."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.gpsa import ALPHA_MIN, GPSA, relative_encodings, softplus_inverse
from core.nn.gpsa_convit import ConvitGPSA
from core.nn.gpsa_tcnn import TcnnGPSA


def _randomize(g: GPSA, *, lam_scale: float = 1.5, qk_std: float = 0.5) -> GPSA:
    """Random gates (both branches matter), content projections and positional parameters."""
    with torch.no_grad():
        g.gating_param.normal_(0.0, lam_scale)
        nq = 2 * g.num_heads * g.qk_head_dim
        g.qkv_weight[:nq].normal_(0.0, qk_std)
        g.qkv_weight[nq:].add_(0.3 * torch.randn_like(g.qkv_weight[nq:]))
        if g.qkv_bias is not None:
            g.qkv_bias.normal_()
        if g.bias is not None:
            g.bias.normal_()
        if g.positional == "softplus":
            g.pos_alpha.uniform_(-0.5, 2.0)
            g.pos_center.add_(0.7 * torch.randn_like(g.pos_center))
        else:
            g.pos_weight.normal_()
    return g


def reference_gpsa(g: GPSA, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
    """[TCNN21] Eq. 5-7 / [ConViT21] Eq. 6-7 evaluated literally, head by head, with the dense encodings r_ij.

    T-CNN mode: queries at the conv's output positions, positional softmax over the zero-padded key grid
    (padded keys hold zero values), content softmax over the real pixels; output [B, D_out, Hq, Wq].
    ConViT mode: tokens [B, N, C] on grid ``size``.
    """
    nh, dq = g.num_heads, g.qk_head_dim
    if g.mode == "tcnn":
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # [B, L, C]
    else:
        b, _, c = x.shape
        h, w = size
        tokens = x
    p, s = g.padding, (g.stride if g.stride_mode == "exact" else 1)
    hp, wp = h + 2 * p, w + 2 * p
    # padded grid tokens (zeros outside)
    grid = torch.zeros(b, hp, wp, c, dtype=x.dtype)
    grid[:, p : p + h, p : p + w] = tokens.reshape(b, h, w, c)
    keys_pad = grid.reshape(b, hp * wp, c)
    real = torch.zeros(hp, wp, dtype=torch.bool)
    real[p : p + h, p : p + w] = True
    real = real.flatten()
    qrows = list(range(0, h, s))
    qcols = list(range(0, w, s))
    qidx = torch.tensor([(r + p) * wp + (cc + p) for r in qrows for cc in qcols])
    xq = keys_pad[:, qidx]  # [B, Lq, C]
    # relative encodings from every query to every padded key
    pos_all = torch.stack(
        torch.meshgrid(torch.arange(hp) - p, torch.arange(wp) - p, indexing="ij"), -1
    ).reshape(-1, 2)
    qpos = pos_all[qidx].to(x.dtype)
    delta = pos_all.to(x.dtype)[None] - qpos[:, None]  # [Lq, Lk_pad, 2] (row, col)
    r = torch.cat([(delta**2).sum(-1, keepdim=True), delta], -1)  # (|d|^2, d1, d2)
    if g.positional == "softplus":
        a = g.alpha().to(x.dtype)
        cen = g.centers().to(x.dtype)
        vpos = -a[:, None] * torch.cat([torch.ones(nh, 1, dtype=x.dtype), -2 * cen], 1)  # [TCNN21] Eq. 4
    else:
        vpos = g.pos_weight.to(x.dtype)
    wqkv = g.qkv_weight.to(x.dtype)
    bqkv = None if g.qkv_bias is None else g.qkv_bias.to(x.dtype)
    qkv_pad = F.linear(keys_pad, wqkv, bqkv)
    qkv_q = F.linear(xq, wqkv, bqkv)
    lam = g.gating_param.to(x.dtype)
    out = 0.0
    for hd in range(nh):
        q = qkv_q[..., hd * dq : (hd + 1) * dq]
        k = qkv_pad[:, real, nh * dq + hd * dq : nh * dq + (hd + 1) * dq]
        if g.mode == "tcnn":
            vals = qkv_pad[..., 2 * nh * dq :]  # shared W_val, all channels
            ky, kx = divmod(hd, g.kernel_size)
            wout = g.weight[:, :, ky, kx].to(x.dtype)  # [D_out, C]
        else:
            dv = g.v_dim // nh
            vals = qkv_pad[..., 2 * nh * dq + hd * dv : 2 * nh * dq + (hd + 1) * dv]
            wout = g.weight[:, hd * dv : (hd + 1) * dv].to(x.dtype)
        vals = vals * real[None, :, None]  # padded keys carry zero values (a conv's zero padding)
        content = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dq), -1)  # over real keys
        positional = torch.softmax(r @ vpos[hd], -1)  # over all (padded) keys
        gate = torch.sigmoid(lam[hd])
        y = (1 - gate) * content @ vals[:, real] + gate * positional @ vals
        out = out + y @ wout.t()
    if g.bias is not None:
        out = out + g.bias.to(x.dtype)
    if g.mode == "tcnn":
        out = out.transpose(1, 2).reshape(b, -1, len(qrows), len(qcols))
        if g.stride > 1 and g.stride_mode == "s1":
            out = F.avg_pool2d(out, g.stride, g.stride, ceil_mode=True, count_include_pad=False)
    return out


# ------------------------------------------------------------------------------------------ encodings
def test_relative_encodings_by_hand() -> None:
    r = relative_encodings(2, 3)  # tokens row-major: i=(0,0) -> 0, j=(1,2) -> 5
    assert r.shape == (6, 6, 3)
    assert r[0, 5].tolist() == [5.0, 1.0, 2.0]
    assert r[5, 0].tolist() == [5.0, -1.0, -2.0]
    assert r[1, 3].tolist() == [2.0, 1.0, -1.0]  # (0,1) -> (1,0)
    assert torch.all(r.diagonal(dim1=0, dim2=1) == 0)


@pytest.mark.parametrize("positional", ["softplus", "linear"])
def test_positional_factors_equal_dense_softmax(positional: str) -> None:
    torch.manual_seed(0)
    g = _randomize(ConvitGPSA(16, num_heads=4, positional=positional)).double()
    h, w = 3, 5
    r = relative_encodings(h, w, dtype=torch.float64)
    if positional == "softplus":
        vpos = -g.alpha()[:, None] * torch.cat([torch.ones(4, 1, dtype=torch.float64), -2 * g.centers()], 1)
    else:
        vpos = g.pos_weight
    dense = torch.softmax(torch.einsum("ijr,hr->hij", r, vpos), -1)
    with torch.no_grad():
        torch.testing.assert_close(g.positional_attention(h, w), dense, rtol=1e-12, atol=1e-14)


def test_softplus_alpha_init_is_exact_and_positive() -> None:
    for a in [1e-3, 0.5, 1.0, 50.0, 1e3]:
        g = ConvitGPSA(8, num_heads=4, alpha_init=a)
        torch.testing.assert_close(g.alpha(), torch.full((4,), a), rtol=1e-6, atol=0.0)
        assert float(softplus_inverse(a)) == pytest.approx(
            a + math.log(-math.expm1(-5 * a)) / 5, rel=1e-12
        )  # x = a + log(1 - e^{-5a}) / 5
    # footnote 1 of [TCNN21] writes softplus(-alpha~); ours is softplus(+alpha~): increasing in alpha~
    g = ConvitGPSA(8, num_heads=4)
    a0 = g.alpha().detach().clone()
    with torch.no_grad():
        g.pos_alpha.add_(1.0)
    assert torch.all(g.alpha() > a0)


def test_alpha_stays_positive_after_large_lr_steps() -> None:
    torch.manual_seed(0)
    g = ConvitGPSA(8, num_heads=4)
    opt = torch.optim.Adam([g.pos_alpha], lr=10.0)
    for _ in range(30):  # push alpha~ far negative: Adam's step does not shrink with the softplus slope
        opt.zero_grad()
        g.alpha().sum().backward()
        opt.step()
    raw = g.pos_alpha.detach()
    assert float(raw.max()) < -30
    assert float(F.softplus(raw, beta=5).max()) == 0.0  # a plain softplus has underflowed to exactly 0 here
    assert torch.all(g.alpha() >= ALPHA_MIN)
    y = g(torch.randn(2, 9, 8))
    assert torch.isfinite(y).all()
    # and plain SGD at a huge learning rate on the positional parameters of a real loss
    g2 = _randomize(ConvitGPSA(8, num_heads=4, lambda_init=3.0))
    opt2 = torch.optim.SGD([g2.pos_alpha, g2.pos_center], lr=1e4)
    x = torch.randn(2, 16, 8)
    for _ in range(5):
        opt2.zero_grad()
        (g2(x) ** 2).sum().backward()
        opt2.step()
    assert torch.isfinite(g2.pos_alpha).all() and torch.all(g2.alpha() > 0)


# ------------------------------------------------------------------------------ against the formula
@pytest.mark.parametrize("impl", ["sdpa", "dense"])
@pytest.mark.parametrize("positional", ["softplus", "linear"])
def test_convit_mode_matches_reference(impl: str, positional: str) -> None:
    torch.manual_seed(1)
    for qk_head_dim in (None, 5):  # timm's D / heads, and a different q/k width
        g = ConvitGPSA(
            12, num_heads=4, positional=positional, qkv_bias=True, attn_impl=impl, qk_head_dim=qk_head_dim
        )
        g = _randomize(g)
        x = torch.randn(2, 15, 12)
        with torch.no_grad():
            y = g(x, (3, 5))  # non-square grid
            ref = reference_gpsa(g.double(), x.double(), (3, 5)).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "dense"])
@pytest.mark.parametrize(
    "stride,dilation,stride_mode,hw",
    [(1, 1, "exact", (5, 7)), (2, 1, "exact", (7, 6)), (2, 1, "s1", (5, 8)), (1, 2, "exact", (6, 5))],
)
def test_tcnn_mode_matches_reference(
    impl: str, stride: int, dilation: int, stride_mode: str, hw: tuple
) -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(6, 5, 3, stride=stride, padding=dilation, dilation=dilation, bias=True)
    g = _randomize(TcnnGPSA.from_conv(conv, stride_mode=stride_mode, attn_impl=impl))
    x = torch.randn(2, 6, *hw)
    with torch.no_grad():
        y = g(x)
        ref = reference_gpsa(g.double(), x.double()).float()
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- T-CNN equivalence to conv
def test_head_to_tap_mapping_with_asymmetric_kernel() -> None:
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
    x = torch.randn(2, 3, 6, 5)
    for ky in range(3):
        for kx in range(3):  # a kernel with a single nonzero tap: the output is a pure shift of x
            with torch.no_grad():
                conv.weight.zero_()
                conv.weight[:, :, ky, kx] = torch.randn(4, 3)
            g = TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0)
            h = 3 * ky + kx
            assert g.centers()[h].tolist() == [ky - 1, kx - 1]
            with torch.no_grad():
                torch.testing.assert_close(g(x), conv(x), rtol=0, atol=1e-5)
                # the head's attention for an interior query sits on query + (ky - 1, kx - 1)
                maps = g.attention_maps(x, part="positional")[0, h].reshape(6, 5, 6, 5)
                assert maps[2, 2].argmax().item() == (2 + ky - 1) * 5 + (2 + kx - 1)
    # a fully asymmetric kernel; its transpose gives a different function, so an ordering bug shows
    with torch.no_grad():
        conv.weight.copy_(torch.randn_like(conv.weight))
    g = TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0)
    with torch.no_grad():
        y = g(x)
        torch.testing.assert_close(y, conv(x), rtol=0, atol=1e-5)
        flipped = F.conv2d(x, conv.weight.transpose(2, 3), padding=1)
        assert (y - flipped).abs().max() > 0.1


@pytest.mark.parametrize("hw", [(7, 7), (6, 9), (5, 8), (9, 4)])
@pytest.mark.parametrize("stride,dilation,bias", [(1, 1, True), (2, 1, False), (2, 1, True), (1, 2, False)])
def test_tcnn_equals_conv_at_large_alpha_lambda(hw: tuple, stride: int, dilation: int, bias: bool) -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(8, 12, 3, stride=stride, padding=dilation, dilation=dilation, bias=bias)
    if bias:
        with torch.no_grad():
            conv.bias.normal_()
    g = TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0)
    assert g.weight.shape == conv.weight.shape and torch.equal(g.weight, conv.weight)
    x = torch.randn(3, 8, *hw)
    with torch.no_grad():
        y, ref = g(x), conv(x)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=0, atol=2e-5)


def test_s1_mode_is_stride1_conv_then_avg_pool() -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
    g = TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0, stride_mode="s1")
    for hw in [(8, 8), (7, 5)]:
        x = torch.randn(2, 4, *hw)
        with torch.no_grad():
            y = g(x)
            ref = F.avg_pool2d(
                F.conv2d(x, conv.weight, padding=1), 2, 2, ceil_mode=True, count_include_pad=False
            )
            assert y.shape == conv(x).shape
            torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
            assert (y - conv(x)).abs().max() > 1e-2  # BoTNet-style: not the strided conv's function


def test_paper_init_is_not_exact_but_large_init_is() -> None:
    torch.manual_seed(6)
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    x = torch.randn(2, 8, 6, 6)
    errs = {}
    for a in (1.0, 5.0, 50.0):
        g = TcnnGPSA.from_conv(conv, alpha_init=a, lambda_init=a)
        with torch.no_grad():
            errs[a] = (g(x) - conv(x)).abs().max().item()
    assert errs[1.0] > errs[5.0] > errs[50.0]
    assert errs[50.0] < 1e-5 < 1e-2 < errs[1.0]


# ------------------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("mode", ["convit", "tcnn"])
def test_sdpa_and_dense_paths_agree(mode: str) -> None:
    torch.manual_seed(7)
    if mode == "convit":
        a = _randomize(ConvitGPSA(18, num_heads=9, attn_impl="sdpa"))
        x = torch.randn(3, 40, 18)
        args: tuple = (x, (5, 8))
    else:
        a = _randomize(TcnnGPSA.from_conv(nn.Conv2d(10, 7, 3, padding=1), attn_impl="sdpa"))
        x = torch.randn(3, 10, 9, 10)  # 9 x 10 takes the factorised positional path, 5 x 5 the dense one
        args = (x,)
    b = type(a)(**_init_kwargs(a), attn_impl="dense")
    b.load_state_dict(a.state_dict())
    for xx in (args, (torch.randn(3, 10, 5, 5),) if mode == "tcnn" else (torch.randn(2, 25, 18),)):
        with torch.no_grad():
            torch.testing.assert_close(a(*xx), b(*xx), rtol=1e-5, atol=1e-5)


def test_auto_attention_path_by_mode_and_map_size() -> None:
    """attn_impl="auto" on CPU: the dense path for the T-CNN mode at any size and for the ConViT mode up to
    `_DENSE_MAX_TOKENS` tokens; SDPA above; an explicit choice always wins; never dense on another device."""
    from core.nn.gpsa_convit import _DENSE_MAX_TOKENS

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    convit, tcnn = ConvitGPSA(18, num_heads=9), TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, padding=1))
    assert convit._use_dense(cpu, 49) and convit._use_dense(cpu, _DENSE_MAX_TOKENS)
    assert not convit._use_dense(cpu, _DENSE_MAX_TOKENS + 1) and not convit._use_dense(cpu, 196)
    assert tcnn._use_dense(cpu, 49) and tcnn._use_dense(cpu, 3136)
    assert not convit._use_dense(cuda, 49) and not tcnn._use_dense(cuda, 49)
    assert not ConvitGPSA(18, num_heads=9, attn_impl="sdpa")._use_dense(cpu, 49)
    assert ConvitGPSA(18, num_heads=9, attn_impl="dense")._use_dense(cpu, 196)
    # the auto module computes what both explicit paths compute, on either side of the threshold
    torch.manual_seed(3)
    a = _randomize(ConvitGPSA(18, num_heads=9))
    for impl in ("sdpa", "dense"):
        b = type(a)(**_init_kwargs(a), attn_impl=impl)
        b.load_state_dict(a.state_dict())
        for n in (49, 121):
            x = torch.randn(2, n, 18)
            with torch.no_grad():
                torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize(
    "out_dim", [2, 11]
)  # B * L >= / < heads * D_out: W_val folded / projected in grad mode
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_tcnn_dense_forms_match_reference(stride: int, out_dim: int, layout: str) -> None:
    """The dense T-CNN path has an autograd-off form (expanded-weight matmuls, W_val folded into the output
    weight and cached) and an autograd-on form (1x1 convs, W_val folded only when cheaper); both, for NCHW and
    channels_last inputs, equal the formula; the cached folded weight follows in-place updates of W_val."""
    torch.manual_seed(21)
    g = _randomize(TcnnGPSA.from_conv(nn.Conv2d(5, out_dim, 3, stride=stride, padding=1, bias=True)))
    x = torch.randn(2, 5, 5, 6)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    ref = reference_gpsa(g.double(), x.double()).float()
    g.float()
    with torch.no_grad():
        y_eval = g(x)
    xg = x.clone().requires_grad_()
    y_train = g(xg)
    y_train.square().sum().backward()
    for y in (y_eval, y_train.detach()):
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    assert g.qkv_weight.grad[2 * g.num_heads * g.qk_head_dim :].abs().max() > 0  # W_val gets its gradient
    with torch.no_grad():
        g.qkv_weight[2 * g.num_heads * g.qk_head_dim :].mul_(-1.5)  # only W_val changes
        y_new = g(x)
        ref_new = reference_gpsa(g.double(), x.double()).float()
    g.float()
    torch.testing.assert_close(y_new, ref_new, rtol=1e-5, atol=1e-5)
    assert (y_new - y_eval).abs().max() > 1e-2


def _init_kwargs(g: GPSA) -> dict:
    kw = dict(in_dim=g.in_dim, out_dim=g.out_dim, positional=g.positional)
    kw["qkv_bias"] = g.qkv_bias is not None
    kw["bias"] = g.bias is not None
    if g.mode == "tcnn":
        kw.update(kernel_size=g.kernel_size, stride=g.stride, dilation=g.dilation, stride_mode=g.stride_mode)
    else:
        kw["num_heads"] = g.num_heads
    return kw


@pytest.mark.parametrize(
    "mode,impl,stride",
    [
        ("convit", "sdpa", 1),
        ("convit", "dense", 1),
        ("tcnn", "sdpa", 2),
        ("tcnn", "dense", 1),
        ("tcnn", "dense", 2),
        ("tcnn-fold", "dense", 1),
    ],
)
def test_gradcheck(mode: str, impl: str, stride: int) -> None:
    torch.manual_seed(8)
    if mode == "convit":
        g = ConvitGPSA(8, num_heads=4, attn_impl=impl, qkv_bias=True)
        x = torch.randn(2, 12, 8, dtype=torch.float64)
        extra: tuple = ((3, 4),)
    else:  # "tcnn-fold": B * L >= heads * D_out, W_val folded into the output weight with autograd on
        g = TcnnGPSA(4, 2 if mode == "tcnn-fold" else 6, stride=stride, attn_impl=impl)
        x = torch.randn(2, 4, 5, 3, dtype=torch.float64)
        extra = ()
    g = _randomize(g).double()
    names = [n for n, _ in g.named_parameters()]

    def f(xx: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(g, dict(zip(names, params)), (xx, *extra))

    assert torch.autograd.gradcheck(
        f, (x.requires_grad_(), *g.parameters()), eps=1e-6, atol=1e-6, fast_mode=True
    )


@pytest.mark.parametrize("mode", ["convit", "tcnn", "tcnn-s2"])
def test_float32_gradients_match_float64(mode: str) -> None:
    """float32 gradients (CPU kernels: oneDNN convolutions, BLAS GEMMs) equal float64 autograd's for the input
    and every parameter."""
    torch.manual_seed(9)
    if mode == "convit":
        g, x, extra = ConvitGPSA(24, num_heads=4, qkv_bias=True), torch.randn(3, 20, 24), ((4, 5),)
    else:
        g = TcnnGPSA(12, 10, stride=2 if mode == "tcnn-s2" else 1)
        x, extra = torch.randn(3, 12, 7, 6), ()
    g = _randomize(g)
    g64 = copy.deepcopy(g).double()
    gy = torch.randn_like(g(x, *extra))
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    g(x32, *extra).backward(gy)
    g64(x64, *extra).backward(gy.double())
    pairs = [("input", x32.grad, x64.grad)]
    pairs += [(n, p.grad, q.grad) for (n, p), q in zip(g.named_parameters(), g64.parameters())]
    for name, got, ref in pairs:
        assert got is not None, name
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item(), msg=name)


@pytest.mark.parametrize("mode", ["convit", "tcnn"])
def test_gradients_reach_every_parameter(mode: str) -> None:
    torch.manual_seed(9)
    if mode == "convit":
        g = ConvitGPSA(12, num_heads=4, lambda_init=0.0)
        y = g(torch.randn(2, 16, 12))
    else:
        g = TcnnGPSA.from_conv(nn.Conv2d(6, 6, 3, padding=1, bias=True), lambda_init=0.0)
        with torch.no_grad():
            g.qkv_weight[: 2 * g.num_heads * g.qk_head_dim].normal_(0, 0.3)
        y = g(torch.randn(2, 6, 5, 5))
    (y**2).sum().backward()
    nq = g.num_heads * g.qk_head_dim
    grads = {
        "q": g.qkv_weight.grad[:nq],
        "k": g.qkv_weight.grad[nq : 2 * nq],
        "v": g.qkv_weight.grad[2 * nq :],
        "out": g.weight.grad,
        "bias": g.bias.grad,
        "lambda": g.gating_param.grad,
        "alpha": g.pos_alpha.grad,
        "centers": g.pos_center.grad,
    }
    for name, gr in grads.items():
        assert gr is not None and torch.isfinite(gr).all() and gr.abs().max() > 0, name
    assert (g.gating_param.grad != 0).all() and (g.pos_alpha.grad != 0).all()


# -------------------------------------------------------------------------------- cache, dtype, device
def test_encoding_cache_per_size_and_follows_to() -> None:
    g = ConvitGPSA(8, num_heads=4)
    g(torch.randn(1, 15, 8), (3, 5))
    g(torch.randn(1, 16, 8))
    keys = {(k[1], k[2], str(k[4]), k[5]) for k in g._enc_cache}
    assert (3, 3, "cpu", torch.float32) in keys and (5, 5, "cpu", torch.float32) in keys
    g.double()
    assert g._enc_cache == {}  # .to()/.double() drop the cached encodings
    y = g(torch.randn(1, 15, 8, dtype=torch.float64), (3, 5))
    assert y.dtype == torch.float64
    assert all(k[5] == torch.float64 for k in g._enc_cache)
    g.to("meta")
    assert g._enc_cache == {}


@pytest.mark.parametrize("mode", ["convit", "tcnn"])
def test_positional_reuse_without_grad_tracks_parameter_updates(mode: str) -> None:
    torch.manual_seed(13)
    if mode == "convit":
        g, x = _randomize(ConvitGPSA(12, num_heads=4)), torch.randn(2, 20, 12)
        args: tuple = ((4, 5),)
    else:
        g, x = _randomize(TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, padding=1))), torch.randn(2, 4, 5, 6)
        args = ()
    with torch.no_grad():
        y0 = g(x, *args)
        assert torch.equal(g(x, *args), y0)  # reused
        opt = torch.optim.SGD(g.parameters(), lr=0.5)
        for p in g.parameters():
            p.grad = torch.randn_like(p)
        opt.step()  # in-place updates bump the parameters' version counters
        y1 = g(x, *args)
    y_fresh = g(x, *args)  # grad mode: always recomputed
    assert (y1 - y0).abs().max() > 1e-3
    torch.testing.assert_close(y1, y_fresh.detach(), rtol=0, atol=0)


def test_convit_grid_size_and_errors() -> None:
    g = ConvitGPSA(8, num_heads=4)
    with pytest.raises(ValueError, match="not a square grid"):
        g(torch.randn(1, 15, 8))
    g.grid_size = (3, 5)
    assert g(torch.randn(1, 15, 8)).shape == (1, 15, 8)
    with pytest.raises(ValueError, match="odd"):
        TcnnGPSA(8, kernel_size=2)
    with pytest.raises(ValueError, match="grouped"):
        TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, padding=1, groups=2))
    with pytest.raises(ValueError, match="padding"):
        TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, padding=0))
    with pytest.raises(TypeError, match="abstract"):
        GPSA(8, num_heads=4)  # the shared base: build TcnnGPSA or ConvitGPSA
    with pytest.raises(ValueError, match="divisible"):
        ConvitGPSA(10, num_heads=4)


def test_two_layers_over_one_base() -> None:
    """TcnnGPSA and ConvitGPSA are GPSAs (isinstance checks elsewhere hold), name themselves by a class-level
    ``mode``, and share the positional piece with PSA; the T-CNN one keeps the conv's parameter names."""
    from core.nn.positional import PositionalHeads

    t, c = TcnnGPSA.from_conv(nn.Conv2d(4, 6, 3, padding=1)), ConvitGPSA(8, num_heads=4)
    assert isinstance(t, GPSA) and isinstance(c, GPSA) and isinstance(t, PositionalHeads)
    assert (t.mode, c.mode, TcnnGPSA.mode, ConvitGPSA.mode) == ("tcnn", "convit", "tcnn", "convit")
    assert "mode" not in vars(t) and "mode" not in vars(c)
    assert t.weight.shape == (6, 4, 3, 3) and c.weight.shape == (8, 8)
    assert list(t.state_dict()) == [
        "qkv_weight", "weight", "bias", "gating_param", "pos_alpha", "pos_center"
    ]  # fmt: skip
    assert "mode=tcnn" in repr(t) and "kernel_size=3" in repr(t) and "kernel_size" not in repr(c)


def test_autocast_bfloat16_cpu() -> None:
    torch.manual_seed(10)
    for g, x in [
        (_randomize(ConvitGPSA(16, num_heads=4)), torch.randn(2, 16, 16)),
        (_randomize(TcnnGPSA.from_conv(nn.Conv2d(8, 8, 3, padding=1))), torch.randn(2, 8, 5, 5)),
    ]:
        ref = g(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = g(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


# ---------------------------------------------------------------------------------------- analysis
def test_accessors_and_nonlocality_by_hand() -> None:
    torch.manual_seed(11)
    conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
    g = TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0)
    torch.testing.assert_close(g.gate(), torch.sigmoid(torch.tensor(50.0)).expand(9))
    torch.testing.assert_close(g.alpha(), torch.full((9,), 50.0))
    assert g.centers().shape == (9, 2)
    h, w = 4, 5
    x = torch.randn(2, 4, h, w)
    maps = g.attention_maps(x)
    assert maps.shape == (2, 9, h * w, h * w)
    rows = maps.sum(-1)[0]  # keys outside the image (padding) are not in the map: border rows sum below 1
    assert torch.allclose(rows[4], torch.ones(h * w))  # center tap: always inside
    assert rows[0].min() < 0.5  # tap (-1, -1): the top row and left column fall on the padding
    # nonlocality ([ConViT21] Eq. 8): one-hot at Delta_h when the tap is inside the image, nothing otherwise
    expected = []
    for hd in range(9):
        dy, dx = hd // 3 - 1, hd % 3 - 1
        inside = sum(1 for r in range(h) for c in range(w) if 0 <= r + dy < h and 0 <= c + dx < w)
        expected.append(inside * math.hypot(dy, dx) / (h * w))
    torch.testing.assert_close(g.nonlocality(x), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert set(GPSA.positional_parameter_names()) >= {"gating_param", "pos_alpha", "pos_center"}
    assert GPSA.gating_parameter_names() == ("gating_param",)


# -------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["convit", "tcnn"])
def test_cuda_matches_cpu_and_autocast(mode: str) -> None:
    torch.manual_seed(12)
    if mode == "convit":
        g = _randomize(ConvitGPSA(36, num_heads=9))
        x = torch.randn(4, 35, 36)
        args: tuple = ((5, 7),)
    else:
        g = _randomize(TcnnGPSA.from_conv(nn.Conv2d(16, 16, 3, stride=2, padding=1)))
        x = torch.randn(4, 16, 9, 7)
        args = ()
    ref = g(x, *args)
    gc = g.to("cuda")
    y = gc(x.cuda(), *args)
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.float16):
        yh = gc(x.cuda(), *args)
    assert yh.dtype == torch.float16
    torch.testing.assert_close(yh.float().cpu(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    yh.float().sum().backward()
    assert gc.pos_alpha.grad is not None and torch.isfinite(gc.pos_alpha.grad).all()


def _reference_copy(g: TcnnGPSA) -> TcnnGPSA:
    """The same layer computing through the reference path: autograd's graph of the plain ops and F.linear."""
    r = copy.deepcopy(g)
    r.cpp_attention, r.fused_attention, r.conv_output = False, False, False
    return r


def _fused(g: TcnnGPSA) -> TcnnGPSA:
    """``g`` switched to the Python fused attention and the 1x1-conv output GEMM."""
    g.cpp_attention, g.fused_attention, g.conv_output = False, True, True
    return g


def _cpp(g: TcnnGPSA) -> TcnnGPSA:
    """``g`` on the C++ attention (core.nn.gated_attention_cpp), which must have built, and F.linear."""
    from core.nn.gated_attention_cpp import available

    assert available(), "the C++ attention did not build (core.nn.gated_attention_cpp's log line says why)"
    g.cpp_attention, g.fused_attention, g.conv_output = True, False, False
    return g


PATHS = {"fused": _fused, "cpp": _cpp}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "cin,cout,k,stride,dilation,mode,hw,qkv_bias,layout",
    [
        (5, 7, 3, 1, 1, "exact", (5, 6), False, "nchw"),  # B * L >= heads * D_out: W_val folded
        (5, 40, 3, 1, 1, "exact", (5, 6), True, "channels_last"),  # W_val projected, q/k/v biases
        (5, 7, 3, 2, 1, "exact", (7, 5), False, "channels_last"),  # odd map, exact stride
        (6, 6, 3, 3, 1, "exact", (10, 11), False, "nchw"),
        (6, 6, 3, 2, 1, "s1", (7, 7), False, "nchw"),
        (4, 3, 5, 1, 2, "exact", (9, 8), False, "channels_last"),  # 25 heads, dilation 2
    ],
)
def test_fused_attention_equals_reference_path(
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    cin: int,
    cout: int,
    k: int,
    stride: int,
    dilation: int,
    mode: str,
    hw: tuple,
    qkv_bias: bool,
    layout: str,
) -> None:
    """The fused attention (core.nn.gated_attention; one autograd node, chunked, maps recomputed in backward)
    with the 1x1-conv output GEMM, and the C++ attention (core.nn.gated_attention_cpp), compute what the
    reference path computes: the output with autograd on and off, the input's gradient and every parameter's,
    to float32 precision, with chunks that split the batch unevenly (3 images, chunks of 2)."""
    from core.nn import gated_attention

    torch.manual_seed(31)
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=dilation * (k - 1) // 2, dilation=dilation)
    g = PATHS[path](_randomize(TcnnGPSA.from_conv(conv, stride_mode=mode, qkv_bias=qkv_bias)))
    ref = _reference_copy(g)
    x = torch.randn(3, cin, *hw)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    hq, wq, _ = g._query_size(*hw)
    monkeypatch.setattr(gated_attention, "CHUNK_ELEMENTS", 2 * g.num_heads * hq * wq * hw[0] * hw[1])
    results = []
    for m in (g, ref):
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        with torch.no_grad():
            y_eval = m(x)
        results.append([y.detach(), y_eval, xg.grad, *(p.grad for p in m.parameters())])
    assert all(t is not None for t in results[0] + results[1])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results[0][3].abs().max() > 0  # (the qkv weight) every gradient is a real, non-zero one


def test_fused_attention_gradcheck_and_autocast_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-written backward against finite differences in float64, through a chunk boundary; under autocast
    the layer takes the reference path (its backward does not re-cast) and still matches it."""
    from core.nn import gated_attention as ga
    from core.nn.gated_attention import gated_attention

    torch.manual_seed(32)
    b, nh, d, lq, lk, c = 3, 4, 2, 6, 10, 3
    monkeypatch.setattr(ga, "CHUNK_ELEMENTS", 2 * nh * lq * lk)  # chunks of 2 images, then 1
    qt, kt = torch.randn(b * nh, d, lq, dtype=torch.float64), torch.randn(b * nh, d, lk, dtype=torch.float64)
    vt = torch.randn(b, c, lk, dtype=torch.float64)
    pos = 0.5 * torch.rand(nh, lq, lk, dtype=torch.float64).softmax(-1)
    g_con = torch.rand(nh, dtype=torch.float64)
    args = [t.requires_grad_() for t in (qt, kt, vt, pos, g_con)]
    assert torch.autograd.gradcheck(
        lambda *a: gated_attention(*a, 0.7), args, eps=1e-6, atol=1e-7, fast_mode=True
    )
    g = _fused(_randomize(TcnnGPSA(6, 5)))
    x = torch.randn(2, 6, 5, 5)
    assert g._fused_ok(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not g._fused_ok(x)
        torch.testing.assert_close(g(x), _reference_copy(g)(x))


@pytest.mark.parametrize("path", list(PATHS))
def test_fused_attention_equals_conv_at_large_alpha_lambda(path: str) -> None:
    """The fused and C++ paths keep [TCNN21]'s exactness: at alpha = lambda = 50 the GPSA computes the conv it
    was built from (exact stride 2, odd map, channels-last), forward and input gradient."""
    torch.manual_seed(33)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1)
    g = PATHS[path](TcnnGPSA.from_conv(conv, alpha_init=50.0, lambda_init=50.0))
    x = torch.randn(2, 4, 7, 9).contiguous(memory_format=torch.channels_last)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = g(xa), conv(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(yb)
    ya.backward(gy)
    yb.backward(gy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)


def test_cpp_attention_gradcheck_thread_independent_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ kernel's backward against finite differences (float64); its float32 gradients bit-identical with
    1 and 2 threads over 20 images (blocks of 1 and 2 images, the batch sums reduced in a fixed order, not in
    the threads' order); without the extension the layer takes the reference path (and equals it)."""
    from core.nn import gated_attention_cpp as gac

    torch.manual_seed(34)
    b, nh, d, lq, lk, c = 3, 4, 2, 6, 10, 3
    qt = torch.randn(b * nh, 2 * d, lq, dtype=torch.float64)[:, :d]  # a strided view, as the layer passes
    kt = torch.randn(b * nh, d, lk, dtype=torch.float64)
    vt = torch.randn(b, lk, c, dtype=torch.float64).transpose(1, 2)  # a channels-last map's [B, C, L] view
    pos = 0.5 * torch.rand(nh, lq, lk, dtype=torch.float64).softmax(-1)
    g_con = torch.rand(nh, dtype=torch.float64)
    args = [t.detach().requires_grad_() for t in (qt, kt, vt, pos, g_con)]
    assert torch.autograd.gradcheck(lambda *a: _cpp_call(*a), args, eps=1e-6, atol=1e-7, fast_mode=True)

    b = 20  # blocks of 1 and 2 images
    q32, k32 = torch.randn(b * nh, d, lq), torch.randn(b * nh, d, lk)
    v32, dy = torch.randn(b, c, lk), torch.randn(b, lq * nh, c)
    p32, g32 = pos.float(), g_con.float()
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            grads.append(gac.extension().backward(dy, q32, k32, v32, p32, g32, 0.7))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(u, v) for u, v in zip(*grads))
    layer = _cpp(_randomize(TcnnGPSA(5, 4)))
    x = torch.randn(2, 5, 6, 6)
    monkeypatch.setitem(gac._state, "ext", None)
    assert not layer._cpp_ok(x)
    torch.testing.assert_close(layer(x), _reference_copy(layer)(x), rtol=0, atol=0)


def test_every_copy_of_the_code_loads_the_one_build(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ attention's build is named by its content (source, flags, torch, Python ABI) and kept in the user's
    cache, so a copy of the code (a DVC experiment's temporary workspace, a worktree, a test's repository) loads
    the built library instead of compiling its own (42 s of a core each); TCNN_EXTENSIONS_DIR and XDG_CACHE_HOME
    move the cache."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from core.nn.gated_attention_cpp import available, build_root

    assert available()
    built = {p: p.stat().st_mtime_ns for p in build_root().glob("*/*.so")}
    shutil.copytree(Path(__file__).parents[1] / "core", tmp_path / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    code = ("import sys; from core.nn import gated_attention_cpp as g; "
            "print(g.__file__, g.build_root()); sys.exit(not g.available())")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    module, root = res.stdout.split()
    assert Path(module).is_relative_to(tmp_path) and Path(root) == build_root()
    assert {p: p.stat().st_mtime_ns for p in build_root().glob("*/*.so")} == built  # loaded, nothing built
    assert not (tmp_path / "build").exists()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build_root() == tmp_path / "xdg" / "tcnn" / "torch_extensions"
    monkeypatch.setenv("TCNN_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_root() == tmp_path / "ext"


def test_cpp_float32_products_equal_float64_at_every_tile_shape() -> None:
    """The C++ kernel's float32 products (its register-blocked GEMM: 64-column blocks, 16-column blocks, scalar
    tails, 6-row tiles and leftover rows of 1-5; its dot-product kernel for dQ^T: 3 x 4 tiles, leftover rows and
    columns, vector tails) against the same kernel in float64 (plain loops): channels 83 = 64 + 16 + 3, d = 7 and
    a 7 x 7 map (L = 49 = 3 x 16 + 1), forward and every gradient."""
    from core.nn.gated_attention_cpp import extension

    torch.manual_seed(36)
    b, nh, d, lq, lk, c = 3, 9, 7, 49, 49, 83
    qt = torch.randn(b * nh, 2 * d, lq, dtype=torch.float64)[:, :d]
    kt = torch.randn(b * nh, d, lk, dtype=torch.float64)
    vt = torch.randn(b, lk, c, dtype=torch.float64).transpose(1, 2)
    pos = 0.5 * torch.rand(nh, lq, lk, dtype=torch.float64).softmax(-1)
    g_con = torch.rand(nh, dtype=torch.float64)
    dy = torch.randn(b, lq * nh, c, dtype=torch.float64)
    args = (qt, kt, vt, pos, g_con)
    ext = extension()
    y64, y32 = ext.forward(*args, 0.4), ext.forward(*(t.float() for t in args), 0.4)
    torch.testing.assert_close(y32.double(), y64, rtol=1e-5, atol=1e-5 * y64.abs().max().item())
    g64 = ext.backward(dy, *args, 0.4)
    g32 = ext.backward(dy.float(), *(t.float() for t in args), 0.4)
    for u, v in zip(g32, g64):
        torch.testing.assert_close(u.double(), v, rtol=1e-4, atol=1e-5 * v.abs().max().item())


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("stride", [1, 2])
def test_cpp_attention_views_equal_python_kernel(layout: str, stride: int) -> None:
    """The C++ kernel on [B, heads, d, L] views of a projection's output as the layer passes them (NCHW or
    channels-last; at stride 1 q and k as one tensor, `gated_attention_cpp_qk`; at stride 2 the queries from
    their own projection) equals the Python kernel (core.nn.gated_attention) on [B * heads, d, L] copies:
    forward and every gradient to float32 precision, the projection's gradient in the projection's own
    strides (no copy for autograd to make); float64 gradcheck of the one-tensor entry."""
    from core.nn.gated_attention import gated_attention
    from core.nn.gated_attention_cpp import gated_attention_cpp, gated_attention_cpp_qk

    torch.manual_seed(37)
    b, nh, d, c, hw = 3, 9, 5, 11, (6, 7)
    lk = hw[0] * hw[1]
    hq, wq = (hw[0] + 1) // 2, (hw[1] + 1) // 2
    lq = lk if stride == 1 else hq * wq
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format

    def proj(rows: int, h: int, w: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.randn(b, rows, h, w, dtype=dtype).contiguous(memory_format=fmt)
        return t.flatten(2).unflatten(1, (nh, rows // nh))

    both = proj(2 * nh * d, *hw).requires_grad_()  # [B, heads, 2 d, L]: q rows then k rows per head
    qs = proj(nh * d, hq, wq).requires_grad_() if stride == 2 else None
    vt = torch.randn(b, c, *hw).contiguous(memory_format=fmt).flatten(2).requires_grad_()
    pos = (0.5 * torch.rand(nh, lq, lk).softmax(-1)).requires_grad_()
    g_con = torch.rand(nh).requires_grad_()
    dy = torch.randn(b, lq * nh, c)
    leaves = [t for t in (both, qs, vt, pos, g_con) if t is not None]
    if stride == 1:
        y = gated_attention_cpp_qk(both, vt, pos, g_con, 0.4)
    else:
        y = gated_attention_cpp(qs, both[:, :, d:], vt, pos, g_con, 0.4)
    got = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
    ref_q = both[:, :, :d] if stride == 1 else qs
    y_ref = gated_attention(
        ref_q.reshape(b * nh, d, lq), both[:, :, d:].reshape(b * nh, d, lk), vt, pos, g_con, 0.4
    )
    want = [y_ref.detach(), *torch.autograd.grad(y_ref, leaves, dy)]
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5 * max(1.0, v.abs().max().item()))
    assert got[1 if stride == 1 else 2].stride() == (both if stride == 1 else qs).stride()
    assert got[-3].stride() == vt.stride()
    if stride == 1:
        args = [proj(2 * nh * d, 4, 3, torch.float64).requires_grad_()]
        args += [torch.randn(b, c, 4, 3, dtype=torch.float64).contiguous(memory_format=fmt).flatten(2)]
        args += [
            0.5 * torch.rand(nh, 12, 12, dtype=torch.float64).softmax(-1),
            torch.rand(nh, dtype=torch.float64),
        ]
        args = [t.detach().requires_grad_() for t in args]
        assert torch.autograd.gradcheck(
            lambda *a: gated_attention_cpp_qk(*a, 0.7), args, eps=1e-6, atol=1e-7, fast_mode=True
        )


def _cpp_call(*a: torch.Tensor) -> torch.Tensor:
    from core.nn.gated_attention_cpp import gated_attention_cpp

    return gated_attention_cpp(*a, 0.7)


@pytest.mark.parametrize(
    "arch,in_chans,hw",
    [
        ("resnet10_cifar", 1, (20, 18)),
        ("core.models.he_cifar:resnet20", 3, (16, 16)),
    ],
)
def test_cpp_attention_equals_reference_on_converted_families(arch: str, in_chans: int, hw: tuple) -> None:
    """The T-CNN families the project converts (timm's ResNet class, which the project's small nets and
    resnet18/50 share, and the released He et al. CIFAR ResNet-20): the whole network through the C++
    attention equals it through the reference path, logits and every parameter's gradient, in training mode,
    at alpha = lambda = 1 with random gates."""
    from core.models import build
    from core.reparam import gpsa_modules, to_tcnn

    torch.manual_seed(35)
    tcnn = to_tcnn(build("cnn", arch, 10, in_chans=in_chans), alpha_init=1.0, lambda_init=1.0).train()
    layers = [m for _, m in gpsa_modules(tcnn)]
    assert layers and all(isinstance(m, TcnnGPSA) for m in layers)
    for m in layers:
        _cpp(_randomize(m, qk_std=0.2))
    ref = copy.deepcopy(tcnn)
    for m in ref.modules():
        if isinstance(m, TcnnGPSA):
            m.cpp_attention = False
    x = torch.randn(4, in_chans, *hw)
    out = []
    for net in (tcnn, ref):
        y = net(x)
        y.square().mean().backward()
        out.append([y.detach(), *(p.grad for p in net.parameters())])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))
