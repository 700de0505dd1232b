"""The project's ConViT ([ConViT21]): timm's ConViT architecture on `core.nn.gpsa_convit.ConvitGPSA`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from timm.models.convit import GPSA as TimmGPSA
from timm.models.convit import ConVit

from core.nn.gpsa_convit import ConvitGPSA

__all__ = ["CONVIT_CONFIGS", "ConViT", "build_convit"]

# timm's ConViT configs ([ConViT21] Table 1: Ti, S, B; embed_dim is per head, 48 x heads in total).
CONVIT_CONFIGS: dict[str, dict[str, Any]] = {
    "convit_tiny": dict(embed_dim=48, num_heads=4, local_up_to_layer=10, locality_strength=1.0),
    "convit_small": dict(embed_dim=48, num_heads=9, local_up_to_layer=10, locality_strength=1.0),
    "convit_base": dict(embed_dim=48, num_heads=16, local_up_to_layer=10, locality_strength=1.0),
    # Small, for the default data (28 px, 1 channel) on a CPU: 4 x 4 px patches -> 7 x 7 tokens, 4 heads of
    # width 16 (64 channels), 3 GPSA blocks then 1 SA block.
    "convit_fmnist": dict(
        img_size=28, patch_size=4, in_chans=1, embed_dim=16, num_heads=4, depth=4, mlp_ratio=2.0,
        local_up_to_layer=3, locality_strength=1.0,
    ),
}  # fmt: skip


class ConViT(ConVit):
    """timm's ConViT with its GPSA layers replaced by the project's `core.nn.gpsa_convit.ConvitGPSA`.

    Construction reproduces timm's init exactly (timm's GPSA weights are loaded into ours). A timm ConViT
    state_dict loads with ``load_state_dict`` (keys converted by the GPSA), giving timm's logits. Extra option
    ``positional``: "softplus" (default; alpha = softplus(alpha~) > 0) or "linear" (raw v_pos, needed for
    checkpoints whose pos_proj has a non-negative |delta|^2 weight); ``attn_impl``: see `core.nn.gpsa.GPSA`.
    """

    def __init__(
        self,
        *,
        positional: str | None = None,
        attn_impl: str = "auto",
        conv_init: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("attn_drop_rate", 0.0):
            raise ValueError("ConViT: attn_drop_rate is not supported by the project's GPSA")
        if positional is None:
            positional = "softplus" if conv_init else "linear"
        if not conv_init and positional != "linear":
            raise ValueError(
                "ConViT: conv_init=false needs positional='linear' (a randomly initialised v_pos may be anti-local)"
            )
        super().__init__(**kwargs)
        grid = tuple(self.patch_embed.grid_size)
        for i, blk in enumerate(self.blocks):
            old = blk.attn
            if not isinstance(old, TimmGPSA):
                continue
            new = ConvitGPSA(
                old.dim,
                num_heads=old.num_heads,
                qkv_bias=old.qk.bias is not None,
                positional=positional,
                alpha_init=max(float(old.locality_strength), 1e-3),
                proj_drop=old.proj_drop.p,
                attn_impl=attn_impl,
                device=old.qk.weight.device,
                dtype=old.qk.weight.dtype,
            )
            new.grid_size = grid
            if old.qk.weight.device.type != "meta":
                try:
                    new.load_state_dict(old.state_dict())  # timm's init, converted by the GPSA's load hook
                except ValueError as e:
                    raise ValueError(f"ConViT block {i}: {e}") from None
                if not conv_init:
                    _vit_init(new)
            blk.attn = new


@torch.no_grad()
def _vit_init(g: ConvitGPSA) -> None:
    """[ConViT21] Table 3 "no conv init": W_val and v_pos get timm's ViT init (truncated normal, std 0.02, as every
    linear layer of the ConViT) instead of the identity and the locality init of [ConViT21] Eq. 5."""
    qk = 2 * g.num_heads * g.qk_head_dim
    nn.init.trunc_normal_(g.qkv_weight[qk:], std=0.02)
    nn.init.trunc_normal_(g.pos_weight, std=0.02)


def build_convit(arch: str, num_classes: int, **options: Any) -> ConViT:
    if arch not in CONVIT_CONFIGS:
        raise ValueError(f"kind 'convit': unknown arch {arch!r} (choose from {sorted(CONVIT_CONFIGS)})")
    if options.pop("pretrained", False):
        raise ValueError(
            "kind 'convit': pretrained downloads are not supported; load a timm state_dict instead"
        )
    return ConViT(num_classes=num_classes, **{**CONVIT_CONFIGS[arch], **options})
