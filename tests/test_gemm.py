"""core.nn.gemm.linear / project (oneDNN forward; oneDNN or BLAS backward on CPU float32) against F.linear and F.conv2d
in float64: values and gradients, on both backward routes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.nn.gemm import (
    _ROW_BLOCK_FROM,
    BACKWARD_ENV,
    _cpu_vendor,
    _mm_row_blocks,
    _row_blocked,
    linear,
    linear_split,
    onednn_backward,
    project,
    use_onednn,
)


def _inputs(shape: tuple[int, ...], n: int, bias: bool, seed: int = 0) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(n, shape[-1], generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return [x, w, b]


def _close(got: torch.Tensor, ref: torch.Tensor, k: int) -> bool:
    scale = ref.abs().max().item() + 1e-12
    return (got.double() - ref).abs().max().item() <= 1e-6 * max(k, 8) ** 0.5 * scale


ROUTES = ["onednn", "blas"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch) -> str:
    """Run the test with the backward forced onto one route."""
    monkeypatch.setenv(BACKWARD_ENV, request.param)
    return request.param


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "shape,n",
    # (2, 2600, 256) -> 256: 5200 rows, so the BLAS data gradient runs in row blocks with a ragged last block
    [((3136, 504), 1512), ((2, 2600, 256), 256), ((8, 49, 72), 24), ((5, 7, 3, 40), 9), ((1, 1), 1)],
)
def test_matches_float64_linear_values_and_grads(shape, n, bias, route) -> None:
    x, w, b = _inputs(shape, n, bias)
    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    got_in = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref, got = F.linear(*ref_in), linear(*got_in)
    assert got.shape == ref.shape and got.dtype == torch.float32
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(gy.double())
    got.backward(gy)
    for r, g in [(ref, got)] + [(a.grad, c.grad) for a, c in zip(ref_in, got_in) if a is not None]:
        assert _close(g, r, shape[-1])


def test_route_is_taken_on_cpu_float32_and_not_elsewhere() -> None:
    """The route under test really runs (else the test above would only compare F.linear with itself)."""
    x = torch.randn(4, 8)
    assert use_onednn(x) is torch.backends.mkldnn.is_available()
    assert not use_onednn(x.double()) and not use_onednn(x.bfloat16())
    x64, w64 = torch.randn(6, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(linear(x64, w64), F.linear(x64, w64))  # float64 falls back to F.linear exactly


def test_non_contiguous_and_empty_inputs() -> None:
    x, w, b = _inputs((40, 30), 20, True)
    xt = x.t().contiguous().t()  # same values, column-major
    assert not xt.is_contiguous()
    assert torch.allclose(linear(xt, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    empty = torch.randn(0, 30)
    assert linear(empty, w, b).shape == (0, 20)


@pytest.mark.parametrize(
    "rows,k,n",
    [(_ROW_BLOCK_FROM - 1, 256, 256), (_ROW_BLOCK_FROM, 256, 256), (12295, 256, 256), (12295, 72, 64)],
)
def test_row_blocked_gemm_equals_one_gemm(rows, k, n) -> None:
    """The data-gradient GEMM in row blocks: the same product as one GEMM (float64 reference), for a strided
    left operand (the transposed view a backward hands over) and a ragged last block, and for the shapes that
    stay whole (too few rows, too small a right operand); with autograd recording (double backward) it is one
    plain GEMM."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(k, rows, generator=gen).t()  # [rows, k], column-major
    b = torch.randn(k, n, generator=gen)
    assert _row_blocked(rows, b) is (rows >= _ROW_BLOCK_FROM and k * n >= 65536)
    ref = a.double() @ b.double()
    with torch.no_grad():
        got = _mm_row_blocks(a, b)
    assert got.shape == (rows, n) and got.is_contiguous() and _close(got, ref, k)
    aa = a.clone().requires_grad_()
    y = _mm_row_blocks(aa, b)  # grad mode on: differentiable
    (g,) = torch.autograd.grad(y.sum(), aa)
    assert _close(g, b.double().sum(1).expand(rows, k), n)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 2600, 256), (3, 5, 12)])  # blocked (5200 rows) and small
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)])  # (0, 2): one part unused by the loss
def test_linear_split_matches_float64(shape, bias, used, route) -> None:
    """linear_split = F.linear(...).split(sizes): values, and gradients when only some parts reach the loss."""
    sizes = [256, 256, 300] if shape[-1] == 256 else [6, 6, 10]
    x, w, b = _inputs(shape, sum(sizes), bias, seed=7)
    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    got_in = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = F.linear(*ref_in).split(sizes, dim=-1)
    got = linear_split(*got_in, sizes)
    assert [g.shape for g in got] == [r.shape for r in ref]
    gen = torch.Generator().manual_seed(2)
    gys = [torch.randn(r.shape, generator=gen) for r in ref]
    sum((ref[i] * gys[i].double()).sum() for i in used).backward()
    sum((got[i] * gys[i]).sum() for i in used).backward()
    for r, g in zip(ref, got):
        assert _close(g.detach(), r.detach(), shape[-1])
    for a, c in zip(ref_in, got_in):
        if a is not None:
            assert _close(c.grad, a.grad, shape[0] * shape[1])


def test_linear_split_takes_the_split_backward(monkeypatch) -> None:
    """On the BLAS route the parts' gradients feed the GEMMs directly: no split/cat node in the graph."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(9, 8, requires_grad=True)
    monkeypatch.setenv(BACKWARD_ENV, "blas")
    names = _graph_names(linear_split(x, w, None, [3, 6])[1])
    assert "_LinearSplitBackward" in names and "SplitWithSizesBackward0" not in names, names
    monkeypatch.setenv(BACKWARD_ENV, "onednn")
    assert "SplitWithSizesBackward0" in _graph_names(linear_split(x, w, None, [3, 6])[1])


@pytest.mark.parametrize("split", [False, True])
def test_double_backward(split, route) -> None:
    """A gradient of a gradient (create_graph) through linear / linear_split, on a GEMM tall and wide enough for
    row blocks: with autograd recording, the backward takes its differentiable plain-GEMM branch."""
    x = torch.randn(_ROW_BLOCK_FROM + 5, 256, requires_grad=True)
    w = torch.randn(300, 256, requires_grad=True)
    assert _row_blocked(x.shape[0], w)

    def loss(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        if xx.dtype == torch.float64:
            ys = F.linear(xx, ww).split([100, 200], dim=-1)
        else:
            ys = linear_split(xx, ww, None, [100, 200]) if split else linear(xx, ww).split([100, 200], dim=-1)
        return ys[0].pow(2).sum() + ys[1].sum()

    (gx,) = torch.autograd.grad(loss(x, w), x, create_graph=True)
    (gw,) = torch.autograd.grad(gx.pow(2).sum(), w)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (gxd,) = torch.autograd.grad(loss(xd, wd), xd, create_graph=True)
    (gwd,) = torch.autograd.grad(gxd.pow(2).sum(), wd)
    assert _close(gx, gxd.detach(), 300) and _close(gw, gwd, x.shape[0])


def test_bad_shapes_raise_like_f_linear() -> None:
    x, w, _ = _inputs((4, 8), 3, False)
    with pytest.raises(RuntimeError):
        linear(x, w[:, :5])


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_project_matches_float64_conv1x1(stride, channels_last, bias, route) -> None:
    """project() = a 1x1 convolution with stride, for NCHW and channels-last maps (odd, non-square sizes)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 24, 7, 5, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(10, 24, generator=gen)
    b = torch.randn(10, generator=gen) if bias else None
    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    got_in = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = F.conv2d(ref_in[0], ref_in[1][:, :, None, None], ref_in[2], stride=stride)
    got = project(*got_in, stride=stride)
    assert got.shape == ref.shape == (3, 10, 4 if stride == 2 else 7, 3 if stride == 2 else 5)
    gy = torch.randn(ref.shape, generator=gen)
    ref.backward(gy.double())
    got.backward(gy)
    assert _close(got, ref.detach(), 24)
    for a, c in zip(ref_in, got_in):
        if a is not None:
            assert c.grad.shape == a.grad.shape and _close(c.grad, a.grad, 24)
    if stride == 2:  # pixels the strided projection never reads get exactly zero gradient
        assert torch.count_nonzero(got_in[0].grad[:, :, 1::2]) == 0


def _graph_names(y: torch.Tensor) -> set[str]:
    """Names of every node in y's autograd graph."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or type(fn).__name__ in seen:
            continue
        seen.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return seen


def test_backward_route_is_the_one_asked_for(monkeypatch) -> None:
    """The grad graph shows which backward runs: BLAS through core.nn.gemm's Functions, oneDNN through conv2d's."""
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    xm = torch.randn(2, 8, 3, 3, requires_grad=True)
    monkeypatch.setenv(BACKWARD_ENV, "blas")
    assert not onednn_backward()
    for y, fn in ((linear(x, w), "_LinearBackward"), (project(xm, w, None), "_ProjectBackward")):
        names = _graph_names(y)
        assert fn in names and not any("Convolution" in n for n in names), names
    monkeypatch.setenv(BACKWARD_ENV, "onednn")
    assert onednn_backward()
    for y in (linear(x, w), project(xm, w, None)):
        names = _graph_names(y)
        assert "ConvolutionBackward0" in names and not {"_LinearBackward", "_ProjectBackward"} & names, names
    with torch.no_grad():  # no graph at all without autograd
        assert linear(x, w).grad_fn is None and project(xm, w, None).grad_fn is None


def test_auto_backward_route_follows_the_cpu(monkeypatch) -> None:
    """auto: oneDNN backward only on AVX-512 CPUs that are not Intel's (where MKL takes its generic kernels)."""
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    cap = torch.backends.cpu.get_cpu_capability()
    want = cap.startswith("AVX512") and _cpu_vendor() != "GenuineIntel"
    assert onednn_backward() is want
    monkeypatch.setenv(BACKWARD_ENV, "auto")
    assert onednn_backward() is want


def test_bad_backward_route_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(BACKWARD_ENV, "cublas")
    with pytest.raises(ValueError, match=f"{BACKWARD_ENV} must be one of"):
        onednn_backward()
