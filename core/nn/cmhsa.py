"""CMHSA: the two-phase convolution -> self-attention Vision Transformer of [Li21] ("Can Vision Transformers
Perform Convolution?", Sec. 4.1 and Theorem 1).

The model is a patch-input transformer: a patch embedding (P x P patches) gives an h x w grid of tokens of
dimension d = P^2 c, pre-norm blocks x + Mixer(LN(x)), x + MLP(LN(x)), a final LayerNorm, global average
pooling over the tokens and a linear classifier ([Li21] Sec. 4.1 follows Swin: no [cls] token, because the
convolution phase cannot use one). Each token is read as a P x P block of "pixels" with c channels each
(token index (u P + v) c + i = pixel (u, v) of the patch, channel i; [Li21] Sec. 2.2 "flattened patch").

Phase "conv" ([Li21] Sec. 4.1, convolution phase): the token mixer is a K x K convolution c -> c over the
*pixel* grid (hP x wP) of the un-flattened tokens, zero padding K // 2 - [Li21] Eq. 1 on the original resolution,
crossing patch boundaries. With P = 1 this is a plain K x K convolution over the token grid.

Phase "mhsa" (self-attention phase): the mixer is a standard multi-head self-attention with a learned relative
position bias ([Li21] Eq. 2-4): softmax(Q K^T / sqrt(d_qk) + B) V, B_ij = b^h_{key(j) - query(i)} one learned
scalar per head and relative token offset, N_H = (2 ceil((K - 1) / 2P) + 1)^2 heads of value width d_H = d
([Li21] Theorem 1; 9 heads whenever K < 2P, Corollary 4; K^2 heads for P = 1, Corollary 3). `to_mhsa` transfers a
trained convolution phase by the construction in the proof of Theorem 1 ([Li21] A.1-A.2):
  - head r <-> patch offset delta_r in {-R..R}^2 (row-major, R = ceil((K - 1) / 2P)): b^r_{delta_r} = M, all
    other biases 0 (Lemma 2; [Li21] A.1 uses M = 40, "up to machine precision"), so head r attends only to the
    token at offset delta_r;
  - W^Q = 0 (and its bias), so the content logits Q K^T vanish. (The proof also zeroes W^K; zeroing only W^Q
    gives the same function and keeps W^K's random init, so dL/dW^Q = X^T (dS K) is not identically zero:
    with both at zero the content attention sits at a saddle where neither gets a gradient);
  - W^V_r = I_d (bias 0), so head r outputs the whole token at offset delta_r ([Li21] Eq. 14);
  - W^O from the conv kernel ([Li21] A.2 Remark): W^O[(r, s, i), (t, j)] = W^C[j, i, tap] where tap is the
    kernel position of pixel s of token q + delta_r relative to pixel t of token q (0 if outside the kernel);
    the conv bias becomes the W^O bias.
Borders: the conv zero-pads, while plain attention renormalises over the existing tokens, so a head whose
offset points outside the grid would average everything instead of reading zeros ([Li21]'s proof ignores
borders). The MHSA therefore attends over the token grid padded by R rings of zero tokens (key = value = 0,
content logit 0, relative bias as for any offset): exactly the conv's zero padding, and at M = 40 the transfer
reproduces the convolution phase to float32 rounding (max abs error ~1e-6 on the final features; tests).

Trade-off to know: at M = 40 the relative-bias softmax is saturated (off-target mass < 1e-15), so the
gradients into the biases and W^Q are ~1e-16 and the attention pattern barely moves under training; a smaller
``bias_init`` (e.g. 10) trains the attention at an exactness error of order (N - 1) e^{-M}.

The relative bias tables are sized for the token grid at ``img_size``; larger grids clip offsets beyond the
table to its edge (inside the table nothing changes).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, PatchEmbed, trunc_normal_

from core.nn.locality import grid_distances, nonlocality

__all__ = [
    "CMHSA",
    "CMHSA_ARCHS",
    "ConvMixer",
    "RelPosMHSA",
    "build_cmhsa",
    "check_phase_option",
    "mhsa_modules",
    "to_mhsa",
]

PHASES = ("conv", "mhsa")

# name: CMHSA kwargs. d = patch_size^2 * pixel_dim.
CMHSA_ARCHS: dict[str, dict[str, Any]] = {
    # 28 px single channel (Fashion-MNIST): 7x7 tokens of 4x4 pixels x 8 channels (d = 128).
    "cmhsa_fmnist": dict(
        img_size=28, in_chans=1, patch_size=4, pixel_dim=8, depth=4, kernel_size=3, mlp_ratio=2.0
    ),
    # 32 px RGB (CIFAR): 8x8 tokens of 4x4 pixels x 12 channels (d = 192).
    "cmhsa_cifar": dict(
        img_size=32, in_chans=3, patch_size=4, pixel_dim=12, depth=6, kernel_size=3, mlp_ratio=2.0
    ),
    # [Li21] Table 1 (CMHSA-3 / CMHSA-5): 224 px, P = 16, d = 768 (= 16^2 x 3), 6 layers, d_FFN = 3072.
    "cmhsa3_224": dict(
        img_size=224, in_chans=3, patch_size=16, pixel_dim=3, depth=6, kernel_size=3, mlp_ratio=4.0
    ),
    "cmhsa5_224": dict(
        img_size=224, in_chans=3, patch_size=16, pixel_dim=3, depth=6, kernel_size=5, mlp_ratio=4.0
    ),
}

_OPTIONS = (
    "img_size",
    "in_chans",
    "patch_size",
    "pixel_dim",
    "depth",
    "kernel_size",
    "mlp_ratio",
    "qk_head_dim",
    "drop_rate",
    "drop_path_rate",
)


def patch_radius(kernel_size: int, patch_size: int) -> int:
    """R = ceil((K - 1) / 2P): patch offsets a K x K kernel reaches ([Li21] Eq. 5); N_H = (2R + 1)^2."""
    return math.ceil((kernel_size - 1) / (2 * patch_size))


def _to_pixels(x: torch.Tensor, size: tuple[int, int], p: int) -> torch.Tensor:
    """Tokens [B, h w, p^2 c] -> pixel map [B, c, h p, w p] (token index (u p + v) c + i)."""
    b, _, d = x.shape
    h, w = size
    c = d // (p * p)
    return x.reshape(b, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h * p, w * p)


def _to_tokens(y: torch.Tensor, p: int) -> torch.Tensor:
    """Inverse of `_to_pixels`: [B, c, h p, w p] -> [B, h w, p^2 c]."""
    b, c, hp, wp = y.shape
    h, w = hp // p, wp // p
    return y.reshape(b, c, h, p, w, p).permute(0, 2, 4, 3, 5, 1).reshape(b, h * w, p * p * c)


class ConvMixer(nn.Module):
    """Convolution-phase token mixer: a K x K conv c -> c over the pixel grid of the tokens ([Li21] Eq. 1)."""

    def __init__(self, pixel_dim: int, patch_size: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"cmhsa: kernel_size must be odd, got {kernel_size}")
        self.patch_size = patch_size
        self.conv = nn.Conv2d(pixel_dim, pixel_dim, kernel_size, padding=kernel_size // 2)

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return _to_tokens(self.conv(_to_pixels(x, size, self.patch_size)), self.patch_size)


class RelPosMHSA(nn.Module):
    """MHSA with a learned relative position bias ([Li21] Eq. 2-4) over a key grid padded by R zero tokens.

    Args:
        dim: token dimension d.
        num_heads: N_H.
        grid_size: (h, w) token grid the bias table is sized for.
        pad: R, rings of zero-valued key/value tokens around the grid (emulate a conv's zero padding).
        qk_head_dim: query/key width per head ([Li21] uses d); the value width per head is d (d_H = d).
    """

    def __init__(
        self, dim: int, num_heads: int, grid_size: tuple[int, int], pad: int, qk_head_dim: int | None = None
    ) -> None:
        super().__init__()
        self.dim, self.num_heads, self.pad = dim, num_heads, pad
        self.qk_head_dim = qk_head_dim or dim
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        h, w = self.grid_size
        self.qkv = nn.Linear(dim, num_heads * (2 * self.qk_head_dim + dim))
        self.proj = nn.Linear(num_heads * dim, dim)  # W^O ([Li21] Eq. 2)
        # b^h_delta for delta = key - query in [-(h - 1 + R), h - 1 + R] x [-(w - 1 + R), w - 1 + R].
        self.rel_bias = nn.Parameter(torch.zeros(num_heads, 2 * (h + pad) - 1, 2 * (w + pad) - 1))
        trunc_normal_(self.rel_bias, std=0.02)

    def _bias(self, h: int, w: int) -> torch.Tensor:
        """B [N_H, h w, (h + 2R)(w + 2R)]: bias for each query and each (padded) key, row-major."""
        r = self.pad
        ty, tx = (self.rel_bias.shape[1] + 1) // 2, (self.rel_bias.shape[2] + 1) // 2  # center + 1
        dev = self.rel_bias.device

        def index(n: int, t: int) -> torch.Tensor:
            off = torch.arange(-r, n + r, device=dev)[None, :] - torch.arange(n, device=dev)[:, None]
            return off.clamp(-(t - 1), t - 1) + (t - 1)

        iy, ix = index(h, ty), index(w, tx)
        b = self.rel_bias[:, iy[:, None, :, None], ix[None, :, None, :]]
        return b.reshape(self.num_heads, h * w, (h + 2 * r) * (w + 2 * r))

    def _qkv(self, x: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        b, n, _ = x.shape
        h, w = size
        nh, dq, r = self.num_heads, self.qk_head_dim, self.pad
        q, k, v = self.qkv(x).split([nh * dq, nh * dq, nh * self.dim], dim=-1)
        q = q.reshape(b, n, nh, dq).transpose(1, 2)

        def padded(t: torch.Tensor, d: int) -> torch.Tensor:  # zero tokens around the grid
            t = t.reshape(b, h, w, nh * d)
            t = F.pad(t, (0, 0, r, r, r, r))
            return t.reshape(b, -1, nh, d).transpose(1, 2)

        return q, padded(k, dq), padded(v, self.dim)

    def _grid(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[int, int]:
        size = size or self.grid_size
        if size[0] * size[1] != x.shape[1]:
            raise ValueError(f"RelPosMHSA: {x.shape[1]} tokens do not form a {size[0]}x{size[1]} grid")
        return size

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        h, w = self._grid(x, size)
        q, k, v = self._qkv(x, (h, w))
        bias = self._bias(h, w).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])  # softmax(QK^T/sqrt(d) + B) V
        return self.proj(out.transpose(1, 2).reshape(x.shape[0], h * w, -1))

    # ---- analysis (same names as core.nn.gpsa.GPSA) ----
    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Attention [B, N_H, L, L] for layer input tokens ``x`` (keys: the real tokens, row-major). Border
        rows sum to less than 1: the rest sits on the zero-valued padded keys (a conv's zero padding)."""
        h, w = self._grid(x, size)
        r = self.pad
        q, k, _ = self._qkv(x, (h, w))
        logits = q @ k.transpose(-1, -2) * self.qk_head_dim**-0.5 + self._bias(h, w).to(q.dtype)
        attn = logits.softmax(-1).reshape(*logits.shape[:-1], h + 2 * r, w + 2 * r)
        return attn[..., r : r + h, r : r + w].flatten(-2)

    @torch.no_grad()
    def nonlocality(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Per-head nonlocality [N_H] ([ConViT21] Eq. 8): (1/L) sum_ij A_ij |delta_ij| in tokens, batch-averaged."""
        h, w = self._grid(x, size)
        attn = self.attention_maps(x, (h, w))

        return nonlocality(attn, grid_distances(h, w, device=attn.device)).to(attn.dtype)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.num_heads}, qk_head_dim={self.qk_head_dim}, "
            f"grid_size={self.grid_size}, pad={self.pad}"
        )


class _Block(nn.Module):
    """Pre-norm transformer block: x + DropPath(Mixer(LN(x))), x + DropPath(MLP(LN(x))) ([Li21] Sec. 2.2)."""

    def __init__(self, dim: int, mixer: nn.Module, mlp_ratio: float, drop: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = mixer
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)

    def forward(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), size))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class CMHSA(nn.Module):
    """The CMHSA network of [Li21] Sec. 4.1 in one phase ("conv" or "mhsa"); see the module docstring."""

    def __init__(
        self,
        *,
        num_classes: int,
        phase: str = "conv",
        img_size: int | tuple[int, int] = 28,
        in_chans: int = 1,
        patch_size: int = 4,
        pixel_dim: int = 8,
        depth: int = 4,
        kernel_size: int = 3,
        mlp_ratio: float = 2.0,
        qk_head_dim: int | None = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if phase not in PHASES:
            raise ValueError(f"cmhsa: phase must be one of {PHASES}, got {phase!r}")
        if kernel_size < 1 or kernel_size % 2 != 1:
            raise ValueError(f"cmhsa: kernel_size must be a positive odd int, got {kernel_size}")
        img_hw = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
        if img_hw[0] % patch_size or img_hw[1] % patch_size:
            raise ValueError(f"cmhsa: img_size {img_hw} is not divisible by patch_size {patch_size}")
        self.phase = phase
        self.num_classes = num_classes
        self.config = dict(
            img_size=img_hw,
            in_chans=in_chans,
            patch_size=patch_size,
            pixel_dim=pixel_dim,
            depth=depth,
            kernel_size=kernel_size,
            mlp_ratio=mlp_ratio,
            qk_head_dim=qk_head_dim,
            drop_rate=drop_rate,
            drop_path_rate=drop_path_rate,
        )
        self.patch_size, self.kernel_size = patch_size, kernel_size
        self.embed_dim = dim = patch_size * patch_size * pixel_dim
        self.grid_size = (img_hw[0] // patch_size, img_hw[1] // patch_size)
        self.pad = patch_radius(kernel_size, patch_size)
        self.num_heads = (2 * self.pad + 1) ** 2
        self.patch_embed = PatchEmbed(
            img_hw, patch_size, in_chans, dim, output_fmt="NHWC", strict_img_size=False
        )
        dpr = [float(v) for v in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList(
            _Block(dim, self._mixer(phase), mlp_ratio, drop_rate, dpr[i]) for i in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)

    def _mixer(self, phase: str) -> nn.Module:
        if phase == "conv":
            return ConvMixer(self.config["pixel_dim"], self.patch_size, self.kernel_size)
        return RelPosMHSA(
            self.embed_dim, self.num_heads, self.grid_size, self.pad, self.config["qk_head_dim"]
        )

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # [B, h, w, d]
        size = (x.shape[1], x.shape[2])
        x = x.flatten(1, 2)
        for blk in self.blocks:
            x = blk(x, size)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x.mean(dim=1))  # global average pooling over tokens ([Li21] Sec. 4.1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def extra_repr(self) -> str:
        return f"phase={self.phase}, grid_size={self.grid_size}, heads={self.num_heads}"


def build_cmhsa(arch: str, num_classes: int, *, phase: str = "conv", **options: Any) -> CMHSA:
    """Build CMHSA ``arch`` (a key of `CMHSA_ARCHS`) in ``phase`` "conv" or "mhsa" (random init).

    ``options`` override the arch config: img_size, in_chans, patch_size, pixel_dim, depth, kernel_size,
    mlp_ratio, qk_head_dim, drop_rate, drop_path_rate. A "mhsa" build has the same parameter names and shapes
    as ``to_mhsa(build_cmhsa(arch, num_classes, phase="conv", **options))``, so its state_dict loads.
    """
    if arch not in CMHSA_ARCHS:
        raise ValueError(f"cmhsa: unknown arch {arch!r} (choose from {sorted(CMHSA_ARCHS)})")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"cmhsa: unknown option(s) {unknown} (allowed: {list(_OPTIONS)})")
    return CMHSA(num_classes=num_classes, phase=phase, **{**CMHSA_ARCHS[arch], **options})


def _wo_from_conv(conv: nn.Conv2d, patch_size: int, pad: int) -> torch.Tensor:
    """W^O [d, N_H d] of [Li21] A.2 (Remark) from a K x K conv c -> c; rows (t, j), columns (head r, s, i)."""
    p, k = patch_size, conv.kernel_size[0]
    wc = conv.weight.detach()  # [c_out, c_in, K, K]
    c_out, c_in = wc.shape[:2]
    u = torch.arange(p, device=wc.device)
    blocks = []
    for a in range(-pad, pad + 1):
        for b in range(-pad, pad + 1):
            # tap of source pixel s = (su, sv) of token q + (a, b) seen from target pixel t = (tu, tv) of q
            ty = a * p + u[:, None] - u[None, :] + k // 2  # [su, tu]
            tx = b * p + u[:, None] - u[None, :] + k // 2  # [sv, tv]
            sel_y = F.one_hot(ty.clamp(0, k - 1), k).to(wc.dtype) * ((ty >= 0) & (ty < k))[..., None]
            sel_x = F.one_hot(tx.clamp(0, k - 1), k).to(wc.dtype) * ((tx >= 0) & (tx < k))[..., None]
            # W_r[tu, tv, j, su, sv, i] = sum_{y, x} sel_y[su, tu, y] sel_x[sv, tv, x] W^C[j, i, y, x]
            wr = torch.einsum("aty,bux,jiyx->tujabi", sel_y, sel_x, wc)
            blocks.append(wr.reshape(p * p * c_out, p * p * c_in))
    return torch.cat(blocks, dim=1)


@torch.no_grad()
def to_mhsa(model: CMHSA, *, bias_init: float = 40.0) -> CMHSA:
    """Self-attention phase initialised from a convolution-phase ``model`` by [Li21] Theorem 1's construction.

    Returns a NEW "mhsa" model (``model`` is untouched) computing the same function up to e^{-bias_init}
    ([Li21] A.1: M = 40, float32-exact). Everything but the token mixers is copied; each conv moves into its
    MHSA's W^O (and bias), see the module docstring.
    """
    if not isinstance(model, CMHSA) or model.phase != "conv":
        raise ValueError("to_mhsa: expects a CMHSA model in phase 'conv'")
    if not bias_init > 0:
        raise ValueError(f"to_mhsa: bias_init must be > 0, got {bias_init}")
    ref = next(model.parameters())
    new = CMHSA(num_classes=model.num_classes, phase="mhsa", **copy.deepcopy(model.config))
    new.to(device=ref.device, dtype=ref.dtype)
    shared = {k: v for k, v in model.state_dict().items() if ".attn." not in k}
    missing, unexpected = new.load_state_dict(shared, strict=False)
    if unexpected or any(".attn." not in k for k in missing):
        raise RuntimeError(f"to_mhsa: state mismatch (missing {missing}, unexpected {unexpected})")
    d, nh, r = new.embed_dim, new.num_heads, new.pad
    for old_blk, blk in zip(model.blocks, new.blocks, strict=True):
        conv, mhsa = old_blk.attn.conv, blk.attn
        dq = mhsa.qk_head_dim
        w, bqkv = mhsa.qkv.weight, mhsa.qkv.bias
        w[: nh * dq].zero_()  # W^Q = 0: no content term
        bqkv[: nh * dq].zero_()
        eye = torch.eye(d, device=w.device, dtype=w.dtype)
        w[2 * nh * dq :].copy_(eye.repeat(nh, 1))  # W^V_r = I_d
        bqkv[2 * nh * dq :].zero_()
        mhsa.rel_bias.zero_()
        cy, cx = (mhsa.rel_bias.shape[1] - 1) // 2, (mhsa.rel_bias.shape[2] - 1) // 2
        for h_idx in range(nh):
            a, b = divmod(h_idx, 2 * r + 1)
            mhsa.rel_bias[h_idx, cy + a - r, cx + b - r] = bias_init  # Lemma 2
        mhsa.proj.weight.copy_(_wo_from_conv(conv, new.patch_size, r))
        mhsa.proj.bias.copy_(conv.bias.repeat(new.patch_size**2))
    new.train(model.training)
    return new


def mhsa_modules(model: nn.Module) -> list[tuple[str, RelPosMHSA]]:
    """All `RelPosMHSA` layers of ``model`` as (name, module)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RelPosMHSA)]


def check_phase_option(options: dict[str, Any]) -> None:
    if options.get("phase", "conv") not in ("conv", "mhsa"):
        raise ValueError(f"options.phase: must be 'conv' or 'mhsa', got {options['phase']!r}")
