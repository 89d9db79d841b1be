"""Self-attention over a split domain: every query attends to every rank's points.

diffusers' ``Attention`` (the spatial self-attention of ``UNet2DModel``'s attention blocks
and mid block) is converted by giving it a processor that does what its default one
(``AttnProcessor2_0``) does, with the attention itself spread over the domain:

- its ``group_norm`` runs on the ``(B, C, h, w)`` tile as a domain-parallel ``GroupNorm``
  (statistics over every rank's points; the dense model applies it to the flattened
  ``(B, C, h * w)``, the same groups of the same numbers);
- the projections are per point; the tile's points, flattened, are this rank's queries,
  keys and values;
- one split dim: `ring_attention`, non-causal, the key/value chunks passing around the
  ring (no rank holds the whole sequence). A grid of tiles, or a model converted with
  ``double_backward=True`` (ring attention is differentiable once): the keys and values
  are gathered over the domain (an all-gather per split dim, reduce-scatter backward),
  then attention runs locally. Attention without a mask does not depend on the order of the
  keys, so a tile's flattened points need not be a contiguous piece of the dense
  sequence (a split along W).

Attention the conversion does not know would attend over the tile's points alone,
silently: ``F.scaled_dot_product_attention`` and ``F.multi_head_attention_forward`` (what
``nn.MultiheadAttention`` calls) are refused when a tensor derived from the tile is among
their inputs (`refuse_functional`, see `tensorpar.domain._tiles.marks`); on anything else
(conditioning tokens, features after a global pooling) they run as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.collectives.functional import all_gather
from tensorpar.context.attention import ring_attention
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import TILE

__all__ = ["ATTENTION", "attend", "convert", "per_point", "refusal", "refuse_functional",
           "tokens_block"]

ATTENTION = "diffusers.models.attention_processor.Attention"
_DEFAULT_PROCESSOR = "AttnProcessor2_0"

# (``nn.MultiheadAttention`` skips its fused path while a torch function mode is active)
_FUNCTIONAL_ATTENTION = (F.scaled_dot_product_attention, F.multi_head_attention_forward)


def refusal(module: nn.Module, qualname: str) -> str | None:
    """Why diffusers' ``Attention`` cannot be converted (``None``: it can, or it is none)."""
    if qualname != ATTENTION:
        return None
    attn: Any = module
    processor = type(attn.processor).__name__
    if processor != _DEFAULT_PROCESSOR:
        return (f"Attention with processor {processor}: only diffusers' default "
                f"{_DEFAULT_PROCESSOR} is converted")
    for name, why in (("is_cross_attention", "cross-attention"),
                      ("only_cross_attention", "cross-attention"),
                      ("spatial_norm", "a spatial norm"), ("norm_cross", "a cross norm"),
                      ("added_kv_proj_dim", "added key/value projections"),
                      ("norm_q", "query/key norms"), ("norm_k", "query/key norms")):
        if getattr(attn, name, None):
            return f"Attention with {why} ({name}): only spatial self-attention is converted"
    return None


def convert(module: nn.Module, ctx: DomainContext) -> None:
    """Give diffusers' ``Attention`` the domain-parallel processor."""
    attn: Any = module
    attn.set_processor(_DomainAttnProcessor(ctx, attn.processor))


class _DomainAttnProcessor:
    """``AttnProcessor2_0`` over a split domain (see the module doc)."""

    def __init__(self, ctx: DomainContext, dense: Any) -> None:
        self.ctx = ctx
        self.dense = dense  # for pooled (replicated) features

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 temb: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.ctx
        where = "Attention (domain-parallel)"
        if not ctx.active:
            raise RuntimeError(f"{where}: ran outside the forward of the model it was "
                               f"converted with (activation checkpointing recomputes "
                               f"there); call the converted model itself")
        if ctx.pooled(ctx.marks.kind_of(hidden_states)):
            return self.dense(attn, hidden_states,  # type: ignore[no-any-return]
                              encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, temb=temb)
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(f"{where}: only self-attention without a mask is converted "
                             f"(got encoder_hidden_states or attention_mask)")
        x = hidden_states
        if x.dim() != 4:
            raise ValueError(f"{where}: expected an image tile (B, C, H, W), got shape "
                             f"{tuple(x.shape)}")
        residual = x
        if attn.group_norm is not None:  # converted: statistics over the domain
            x = attn.group_norm(x)
        b, c = x.shape[0], x.shape[1]
        points = x.reshape(b, c, -1).transpose(1, 2)  # (B, h * w, C)
        q, k, v = attn.to_q(points), attn.to_k(points), attn.to_v(points)
        heads = attn.heads
        q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2)
                   for t in (q, k, v))
        with ctx.own_calls():
            out = attend(ctx, x, q, k, v, where)
        ctx.marks.mark(out, TILE)
        ctx.marks.hold_points(out, frozenset({2}), tokens_block(ctx, x))  # (B, heads, points, d)
        out = out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[-1]).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(residual.shape)
        ctx.marks.image_again(out)  # (a mesh's tokens are not followed back: they are)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor  # type: ignore[no-any-return]


def tokens_block(ctx: DomainContext, x: torch.Tensor) -> tuple[int, int] | None:
    """Where a strip's rows lie in the tokens ``x.flatten(2)`` of its image tile ``x``.

    ``(outer, inner)``: the sizes of the spatial dims before and after the split one
    (`tensorpar.domain._forward.points.Block`); ``None`` on a mesh (two split dims).
    """
    if len(ctx.dims) != 1:
        return None
    at = x.dim() + ctx.dims[0]
    return math.prod(x.shape[2:at]), math.prod(x.shape[at + 1:])


def attend(ctx: DomainContext, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, where: str) -> torch.Tensor:
    """Attention of this tile's queries over every rank's keys and values."""
    extents = list(x.shape[2:])  # the tile's points per spatial dim (keys gathered so far)
    split = [x.dim() + d - 2 for d in ctx.dims]  # each split dim among the spatial ones
    sizes = [ctx.sizes_of(i, x.shape[x.dim() + d], where, x.device)
             for i, d in enumerate(ctx.dims)]
    live = [i for i, g in enumerate(ctx.groups) if not g.is_single]
    if not live:
        return F.scaled_dot_product_attention(q, k, v)
    if len(live) == 1 and ctx.fast:  # (ring attention is differentiable once)
        i = live[0]
        rest = math.prod(e for j, e in enumerate(extents) if j != split[i])
        return ring_attention(q, k, v, group=ctx.groups[i],
                              lengths=[s * rest for s in sizes[i]])
    for i in live:  # a grid of tiles: gather the keys and values over each split dim
        rest = math.prod(e for j, e in enumerate(extents) if j != split[i])
        lengths = [s * rest for s in sizes[i]]
        k = all_gather(k, dim=2, group=ctx.groups[i], sizes=lengths)
        v = all_gather(v, dim=2, group=ctx.groups[i], sizes=lengths)
        extents[split[i]] = sum(sizes[i])
    return F.scaled_dot_product_attention(q, k, v)


def per_point(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
              points: Callable[[Any], frozenset[int] | None]) -> bool:
    """Whether functional attention on tiles runs along an axis that holds no split points.

    Attention over each pixel's frames: the points are in the batch dims (`points`
    follows them through the reshapes), so every query's keys are on its own rank.
    ``points(t)``: the dims of the tile ``t`` that hold points (``None``: unknown, or not a
    tile). ``F.scaled_dot_product_attention`` takes ``(..., L, E)``,
    ``F.multi_head_attention_forward`` ``(L, N, E)``.
    """
    if func not in _FUNCTIONAL_ATTENTION:
        return False
    names = ("query", "key", "value")
    qkv = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    tiles = 0
    for t in qkv:
        if not isinstance(t, torch.Tensor):
            continue
        held = points(t)
        batch = set(range(t.dim() - 2)) if func is F.scaled_dot_product_attention \
            else {1} if t.dim() == 3 else set()
        if held is None or not held <= batch:
            return False
        tiles += 1
    return tiles > 0


def refuse_functional(func: Any) -> None:
    """Refuse functional attention called on tiles (it would see the tile's points only)."""
    if func in _FUNCTIONAL_ATTENTION:
        raise RuntimeError(
            f"{func.__name__} on the tiles of a domain-parallel model would attend over "
            f"this tile's points only; attention over a split domain is converted for "
            f"diffusers' and MONAI's attention blocks (or call tensorpar.nn.ring_attention "
            f"on the tile's points yourself). Attention along an axis that is not split "
            f"(each pixel's frames) runs where the tile's reshape into the batch dims is "
            f"followed (flatten, permute, reshape)")
