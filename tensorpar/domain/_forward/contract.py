"""Products that sum tiles over every point they hold: the domain's sum of the tiles' parts.

A Gram matrix ``torch.einsum("bchw,bdhw->bcd", a, b)``, linear attention's
``k.transpose(-2, -1) @ v`` over tokens, or ``einsum("bchw->bc", x)`` sums over the split
dims' points: each rank's product of its tiles is its part, and the domain's is their sum
over the ranks (one all-reduce; replicated, the gradient passing straight back to each tile,
as a global pooling's). Converted where every operand holding points is a tile, the tiles
hold them laid out alike (the same subscripts at the dims holding each split dim, the same
arrangement of a dim holding rows with other dims merged in), and no output dim holds them.
Anything else that pairs or sums points is refused by the caller (`calls`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from tensorpar.domain._forward.following import Follower
from tensorpar.domain._forward.points import MATMULS, einsum_args, einsum_subscripts
from tensorpar.domain._tiles.agree import on_any_rank, over_groups
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["contract_points"]


def contract_points(ctx: DomainContext, follower: Follower, func: Any, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The domain's sum of a product summing its tiles over every point (``None``: not one)."""
    if func is torch.einsum:
        summed = _einsum_sums_points(ctx, follower, args)
        operands = einsum_args(args)[1:]
    elif func in MATMULS and not kwargs:
        summed = _matmul_sums_points(follower, args)
        operands = tuple(args)
    else:
        return None
    tokens = [t for t in operands if isinstance(t, torch.Tensor) and follower.points(t)
              and not follower.laid_out_as_image(t)]
    if len(ctx.dims) > 1 and tokens:
        # a mesh's tokens are read from their parts' sizes, which an empty tile lacks:
        # every rank takes the verdict, or the ranks that sum wait for those that refuse
        summed = not on_any_rank(ctx, not summed, tokens[0].device)
    if not summed:
        return None
    with ctx.own_calls():
        total = over_groups(ctx, func(*args, **kwargs))
    ctx.poolings += 1
    return total


def _einsum_sums_points(ctx: DomainContext, follower: Follower, args: Sequence[Any]) -> bool:
    read = einsum_subscripts(args)
    if read is None:
        return False
    subscripts, output = read
    keys: set[Hashable] = set()
    letters: set[str] = set()
    for sub, t in zip(subscripts, einsum_args(args)[1:], strict=True):
        held = follower.points(t)
        if not held:
            continue
        if not isinstance(t, torch.Tensor) or len(sub) != t.dim() \
                or any(sub.count(sub[d]) > 1 for d in held):  # (a diagonal: "bcii->bc")
            return False
        key = _layout(ctx, follower, t, held, sub)
        if key is None:
            return False
        keys.add(key)
        letters.update(sub[d] for d in held)
    if len(keys) != 1 or letters & set(output):
        return False
    # an operand that is not a tile must not be indexed by the points (a weight over rows)
    return not any(letters & set(sub) for sub, t in zip(subscripts, einsum_args(args)[1:],
                                                        strict=True)
                   if not follower.points(t))


def _matmul_sums_points(follower: Follower, args: Sequence[Any]) -> bool:
    """``a @ b`` whose only points are ``a``'s columns and ``b``'s rows, laid out alike."""
    if len(args) != 2:
        return False
    a, b = args
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or a.dim() < 2 or b.dim() < 2:
        return False
    if follower.points(a) != frozenset({a.dim() - 1}) or \
            follower.points(b) != frozenset({b.dim() - 2}):
        return False
    ctx = follower.ctx
    key_a = _layout(ctx, follower, a, frozenset({a.dim() - 1}), None)
    return key_a is not None and key_a == _layout(ctx, follower, b, frozenset({b.dim() - 2}),
                                                  None)


def _layout(ctx: DomainContext, follower: Follower, t: torch.Tensor, held: frozenset[int],
            sub: str | None) -> Hashable | None:
    """What says which point each element of ``t``'s dims holding points is.

    Two tiles with equal layouts pair the same points (``sub``: ``t``'s subscripts, whose
    letters name its dims). ``None`` where that is not read: a mesh's tile in another
    layout than the image's (a transpose), or a strip whose rows' block is not known.
    """
    def letters(dims: Iterable[int]) -> tuple[str, ...]:
        return tuple(sub[d] for d in dims) if sub is not None else ()
    if len(ctx.dims) == 1:
        block = follower.block(t, held)
        return None if block is None or len(held) != 1 else (letters(held), block)
    if follower.laid_out_as_image(t):
        return letters(follower.image_order())
    merged = follower.merged(t)
    if merged and len(held) == 1:
        return (letters(held), merged)
    return None
