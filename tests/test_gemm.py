"""core.gemm.linear (oneDNN 1x1-conv route on CPU float32) against F.linear in float64: values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.gemm import linear, use_onednn


def _inputs(shape: tuple[int, ...], n: int, bias: bool, seed: int = 0) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(n, shape[-1], generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return [x, w, b]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,n", [((3136, 504), 1512), ((8, 49, 72), 24), ((5, 7, 3, 40), 9), ((1, 1), 1)])
def test_matches_float64_linear_values_and_grads(shape, n, bias) -> None:
    x, w, b = _inputs(shape, n, bias)
    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    got_in = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref, got = F.linear(*ref_in), linear(*got_in)
    assert got.shape == ref.shape and got.dtype == torch.float32
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(gy.double())
    got.backward(gy)
    k = shape[-1]
    for r, g in [(ref, got)] + [(a.grad, c.grad) for a, c in zip(ref_in, got_in) if a is not None]:
        scale = r.abs().max().item() + 1e-12
        assert (g.double() - r).abs().max().item() <= 1e-6 * max(k, 8) ** 0.5 * scale


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


def test_bad_shapes_raise_like_f_linear() -> None:
    x, w, _ = _inputs((4, 8), 3, False)
    with pytest.raises(RuntimeError):
        linear(x, w[:, :5])
