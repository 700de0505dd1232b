"""The T-CNN GPSA's attention core as one autograd node: gated softmax mix and A.X with a hand-written backward.

For one image b, head h and query i ([TCNN21] Eq. 7, the content/positional mix of [ConViT21] Eq. 6):

    S  = scale * Q^T K                        (content scores, [heads, Lq, L] per image)
    P  = softmax_j(S)                         (content attention)
    A  = (1 - sigma(lambda_h)) P + Pos^h      (Pos: the batch-shared, gated positional attention; flushed)
    Y  = A X                                  (rows (query, head), so Y feeds the conv-shaped output GEMM)

Backward (dY given), with g = 1 - sigma(lambda_h) and the softmax Jacobian written out:

    dA   = dY X^T,   dX = A^T dY,   dPos = sum_b dA
    r    = sum_j dA_ij P_ij           (per image, head and query)
    dg   = sum_{b, i} r
    dS   = g P (dA - r)               (softmax backward: P * (dP - sum_j dP P), dP = g dA)
    dQ   = scale K dS^T,  dK = scale Q dS

Autograd's graph for the same expression (`core.nn.gpsa_tcnn.TcnnGPSA._forward_reference`) passes over the
[B, heads, Lq, L] maps about twice as often: a layout copy of dA before the softmax backward, the mix's two
gradient products, a separate reduction for the positional gradient. Here each map pass is one fused op, the
layouts match (A and dA are stored query-major, [B, Lq, heads, L]; P and dS head-major), and the flush of
subnormal probabilities (`core.nn.gated_mix._flush_tiny`) is, as in the reference, treated as the identity in
backward. With autograd off, `gated_attention` runs the same aten ops without the autograd.Function, so a
traced graph holds only aten ops (`core.training.inference` traces and freezes it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["gated_attention"]


#: Images per chunk: the chunk's [images, heads, Lq, L] map holds at most this many elements (or one image):
#: 2**18, 1 MiB in float32, so the passes over it stay in cache and no allocation is large enough to be
#: mapped fresh (and page-faulted) on every call, as the whole batch's maps are (glibc maps blocks >= 32 MiB).
CHUNK_ELEMENTS = 2**18


def _chunks(b: int, per_image: int) -> list[tuple[int, int]]:
    """[start, stop) image ranges of at most max(1, CHUNK_ELEMENTS // per_image) images."""
    n = max(1, CHUNK_ELEMENTS // per_image)
    return [(i, min(b, i + n)) for i in range(0, b, n)]


def _maps(
    qt: torch.Tensor, kt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [n * heads, Lq, L], A [n, Lq, heads, L]) for a chunk of n images: content softmax and mixed attention
    (query-major, flushed on CPU)."""
    bn, _, lq = qt.shape
    nh, _, lk = pos.shape
    b = bn // nh
    s = torch.baddbmm(qt.new_zeros(()).expand(bn, lq, lk), qt.transpose(1, 2), kt, beta=0.0, alpha=scale)
    p = torch.softmax(s, dim=-1)
    a = qt.new_empty(b, lq, nh, lk)
    torch.addcmul(pos, p.view(b, nh, lq, lk), g_con[:, None, None], out=a.permute(0, 2, 1, 3))
    if a.device.type == "cpu":  # subnormal operands slow CPU matmuls: see core.nn.gated_mix._flush_tiny
        F.threshold_(a, torch.finfo(a.dtype).tiny ** 0.5, 0.0)
    return p, a


def _forward(
    qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
) -> torch.Tensor:
    """Y [B, Lq * heads, C] from qt [B * heads, d, Lq], kt [B * heads, d, L], vt [B, C, L], pos [heads, Lq, L]
    and g_con [heads], a chunk of images at a time."""
    bn, _, lq = qt.shape
    b, c, lk = vt.shape
    nh = bn // b
    if torch.jit.is_tracing():  # one chunk: a traced graph must not fix the batch size in unrolled slices
        _, a = _maps(qt, kt, pos, g_con, scale)
        return torch.bmm(a.view(b, lq * nh, lk), vt.transpose(1, 2))
    y = vt.new_empty(b, lq * nh, c)
    for i, j in _chunks(b, nh * lq * lk):
        _, a = _maps(qt[i * nh : j * nh], kt[i * nh : j * nh], pos, g_con, scale)
        torch.bmm(a.view(j - i, lq * nh, lk), vt[i:j].transpose(1, 2), out=y[i:j])
    return y


class _GatedAttention(torch.autograd.Function):
    """Y = ((1 - sigma(lambda)) softmax(scale Q^T K) + Pos) X (module docstring); the maps are recomputed in
    backward, a chunk of images at a time, instead of being stored."""

    @staticmethod
    def forward(
        ctx: Any,
        qt: torch.Tensor,
        kt: torch.Tensor,
        vt: torch.Tensor,
        pos: torch.Tensor,
        g_con: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(qt, kt, vt, pos, g_con)
        ctx.scale = scale
        return _forward(qt, kt, vt, pos, g_con, scale)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        qt, kt, vt, pos, g = ctx.saved_tensors
        scale = ctx.scale
        b, _, lk = vt.shape
        bn, _, lq = qt.shape
        nh = bn // b
        dy = dy.contiguous()
        dqt, dkt, dvt = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        dpos = pos.new_zeros(lq, nh, lk)
        dg = g.new_zeros(nh)
        g3 = g[:, None, None]
        for i, j in _chunks(b, nh * lq * lk):
            n, h0, h1 = j - i, i * nh, j * nh
            p, a = _maps(qt[h0:h1], kt[h0:h1], pos, g, scale)
            dyc = dy[i:j]
            da = torch.bmm(dyc, vt[i:j]).view(n, lq, nh, lk)  # query-major, like A
            torch.bmm(dyc.transpose(1, 2), a.view(n, lq * nh, lk), out=dvt[i:j])
            dpos += da.sum(0)
            dah, p4 = da.permute(0, 2, 1, 3), p.view(n, nh, lq, lk)
            r = torch.linalg.vecdot(dah, p4)  # [n, heads, Lq]
            dg += r.sum((0, 2))
            ds = torch.empty_like(p4)  # head-major, like P: g (dA - r) in one pass, then * P
            torch.addcmul((r * -g[:, None]).unsqueeze(-1), dah, g3, out=ds)
            ds = ds.mul_(p4).view(n * nh, lq, lk)
            torch.bmm(kt[h0:h1], ds.transpose(1, 2), out=dqt[h0:h1])
            torch.bmm(qt[h0:h1], ds, out=dkt[h0:h1])
        return dqt.mul_(scale), dkt.mul_(scale), dvt, dpos.transpose(0, 1), dg, None


def gated_attention(
    qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, scale: float
) -> torch.Tensor:
    """Y = A X [B, Lq * heads, C] (rows (query, head)) with A = g_con softmax(scale Q^T K) + pos.

    qt, kt: queries / keys transposed, [B * heads, d, Lq] and [B * heads, d, L]; vt: values transposed
    [B, C, L] (any strides: an NCHW map's flattened view); pos: [heads, Lq, L], the gated positional attention
    (sigma(lambda) folded in); g_con: [heads], 1 - sigma(lambda). All of one floating dtype.
    """
    if not torch.is_grad_enabled():
        return _forward(qt, kt, vt, pos, g_con, scale)
    return _GatedAttention.apply(qt, kt, vt, pos, g_con, scale)
