"""MONAI's spatial self-attention block and sub-pixel up-sampling over a split domain.

``SpatialAttentionBlock`` (the attention of MONAI's ``DiffusionModelUNet`` and
``AutoencoderKL``) normalises the image with a ``GroupNorm``, flattens its points into a
sequence, runs its ``SABlock`` (attention written out with ``einsum``, or
``F.scaled_dot_product_attention``), and adds the result back to the image. On a tile the
``einsum`` would attend over the tile's points alone, silently. The converted block does
the same steps with the attention spread over the domain: its ``GroupNorm`` converted
(statistics over the domain), the projections per point, then `_attention.attend` (ring
attention over one split dim, keys and values gathered over a grid of tiles).

Refused at the conversion: causal attention, relative positional embeddings, a saved
attention matrix (``save_attn``), attention dropout and an ``attention_dtype``. An
``SABlock`` outside such a block (a vision transformer's tokens) is refused too: which
points its sequence holds is not known.

``SubpixelUpsample`` (``BasicUNet(upsample="pixelshuffle")``, ``UpSample(mode=
"pixelshuffle")``) shuffles with MONAI's own ``pixelshuffle`` (reshapes a tile could not
follow): the converted block runs it through `shuffle.pixel_shuffle`, between its
convolution and its pad-and-pool (both converted as layers).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from tensorpar.domain._layers.attention import attend, tokens_block
from tensorpar.domain._layers.shuffle import pixel_shuffle
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import TILE

__all__ = ["SA_BLOCK", "SPATIAL_ATTENTION", "SUBPIXEL", "convert", "convert_subpixel",
           "handled_inside", "refusal"]

SPATIAL_ATTENTION = "monai.networks.blocks.spatialattention.SpatialAttentionBlock"
SA_BLOCK = "monai.networks.blocks.selfattention.SABlock"
SUBPIXEL = "monai.networks.blocks.upsample.SubpixelUpsample"


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__name__}"


def handled_inside(model: nn.Module) -> set[int]:
    """The modules a converted block runs itself.

    Its ``SABlock`` and that block's rearrangements (einops layers, refused elsewhere).
    """
    return {id(d) for m in model.modules() if _qualname(m) == SPATIAL_ATTENTION
            for d in (getattr(m, "attn", None), *_rearrangements(m)) if d is not None}


def _rearrangements(block: nn.Module) -> tuple[Any, ...]:
    attn = getattr(block, "attn", None)
    return tuple(getattr(attn, name, None) for name in ("input_rearrange", "out_rearrange"))


def refusal(module: nn.Module, qualname: str) -> str | None:
    """Why MONAI's attention cannot be converted (``None``: it can, or it is none)."""
    if qualname == SA_BLOCK:
        return ("SABlock (attention written out by hand) outside a SpatialAttentionBlock: "
                "which points its sequence holds is not known, and on a tile it would attend "
                "over the tile's points alone")
    if qualname != SPATIAL_ATTENTION:
        return None
    attn: Any = getattr(module, "attn", None)
    if attn is None or None in _rearrangements(module) \
            or not hasattr(attn, "use_combined_linear"):
        return ("SpatialAttentionBlock whose SABlock has no input_rearrange, "
                "out_rearrange or use_combined_linear (another MONAI version): not converted")
    for name, why in (("causal", "causal attention"),
                      ("rel_positional_embedding", "relative positional embeddings"),
                      ("save_attn", "a saved attention matrix (save_attn)"),
                      ("dropout_rate", "attention dropout"),
                      ("attention_dtype", "an attention_dtype")):
        if getattr(attn, name, None):
            return f"SpatialAttentionBlock with {why}: not converted"
    return None


def convert(module: nn.Module, ctx: DomainContext) -> None:
    """Give MONAI's ``SpatialAttentionBlock`` its domain-parallel forward."""
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if ctx.pooled(ctx.marks.kind_of(x)):  # pooled (replicated) features: as dense
            return type(self).forward(self, x)  # type: ignore[no-any-return]
        where = "SpatialAttentionBlock (domain-parallel)"
        if not ctx.active:
            raise RuntimeError(f"{where}: ran outside the forward of the model it was "
                               f"converted with (activation checkpointing recomputes there); "
                               f"call the converted model itself")
        residual, shape = x, x.shape
        h = self.norm(x)  # converted: statistics over the domain
        points = h.reshape(*shape[:2], -1).transpose(1, 2)  # (B, points, C)
        attn = self.attn
        if attn.use_combined_linear:
            q, k, v = attn.input_rearrange(attn.qkv(points))
        else:
            q, k, v = (attn.input_rearrange(f(points)) for f in (attn.to_q, attn.to_k,
                                                                 attn.to_v))
        with ctx.own_calls():  # (B, heads, points, head dim)
            out = attend(ctx, h, q, k, v, where)
        ctx.marks.mark(out, TILE)
        ctx.marks.hold_points(out, frozenset({2}), tokens_block(ctx, h))
        out = attn.drop_output(attn.out_proj(attn.out_rearrange(out)))
        out = out.transpose(1, 2).reshape(shape)
        ctx.marks.image_again(out)  # (a mesh's tokens are not followed back: they are)
        return out + residual  # type: ignore[no-any-return]
    module.forward = types.MethodType(forward, module)


def convert_subpixel(module: nn.Module, ctx: DomainContext) -> None:
    """Give MONAI's ``SubpixelUpsample`` its domain-parallel forward."""
    from monai.networks.utils import pixelshuffle  # (MONAI is there: this is its block)

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if ctx.pooled(ctx.marks.kind_of(x)):  # pooled (replicated) features: as dense
            return type(self).forward(self, x)  # type: ignore[no-any-return]
        x = self.conv_block(x)
        k, r = self.dimensions, self.scale_factor
        with ctx.own_calls():
            x = pixel_shuffle(ctx, x, r, up=True, k=k,
                              local=lambda t: pixelshuffle(t, k, r))
        ctx.marks.mark(x, TILE)
        return self.pad_pool(x)  # type: ignore[no-any-return]
    module.forward = types.MethodType(forward, module)
