"""Small agreements of the domain's ranks, so that a decision read from a tile is every rank's.

A forward decides some things from what it sees on its own tile (whether a spread reaches
the tile's size, whether a slice cuts a split dim, the amounts of a pad). Each rank sees a
different tile, and an empty tile sees nothing, so such a decision is agreed by every rank
of the domain in one small all-reduce before it changes what runs: the collectives after it
then run on every rank or on none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorpar.collectives.functional import BackwardMode, ReduceOpName, all_reduce
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["agreed_flags", "agreed_value", "agreed_values", "all_reduced", "on_any_rank",
           "over_groups"]


def on_any_rank(ctx: DomainContext, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the domain (one small all-reduce)."""
    return agreed_flags(ctx, [flag], "max", device)[0]


def agreed_value(ctx: DomainContext, value: float | None, device: torch.device
                 ) -> float | None:
    """The ``value`` every rank that gives one gives (``None``: they differ, or none gives).

    One small all-reduce; a rank with ``value`` ``None`` abstains (an empty tile).
    """
    agreed = agreed_values(ctx, None if value is None else [value], 1, device)
    return None if agreed is None else agreed[0]


def agreed_values(ctx: DomainContext, values: Sequence[float] | None, n: int,
                  device: torch.device) -> list[float] | None:
    """`agreed_value` of ``n`` values at once (``None`` unless every one agrees)."""
    mine = [*values, *(-v for v in values)] if values is not None else [-math.inf] * (2 * n)
    every = all_reduced(ctx, mine, "max", device)
    high, low = every[:n], every[n:]
    if all(h == -lo and h > -math.inf for h, lo in zip(high, low, strict=True)):
        return high
    return None


def agreed_flags(ctx: DomainContext, flags: Sequence[bool], op: ReduceOpName,
                 device: torch.device) -> list[bool]:
    """``flags`` reduced with ``op`` over the domain (``"max"``: any rank's)."""
    return [v == 1.0 for v in all_reduced(ctx, [float(f) for f in flags], op, device)]


def all_reduced(ctx: DomainContext, values: Sequence[float], op: ReduceOpName,
                 device: torch.device) -> list[float]:
    """``values`` reduced with ``op`` over every split dim's group (one small all-reduce each)."""
    t = over_groups(ctx, torch.tensor(values, dtype=torch.float64, device=device), op)
    return [float(v) for v in t.tolist()]


def over_groups(ctx: DomainContext, t: torch.Tensor, op: ReduceOpName = "sum",
                backward: BackwardMode = "identity") -> torch.Tensor:
    """``t`` reduced with ``op`` over every split dim's group: the whole domain's.

    ``backward``: the all-reduce's (``"identity"``: a replicated result used once;
    ``"sum"``: each rank's use counts).
    """
    for g in ctx.groups:
        if not g.is_single:
            t = all_reduce(t, op=op, backward=backward, group=g)
    return t
