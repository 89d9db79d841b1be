"""Reductions of a tile along its split points, inside a converted model's forward.

A reduction along a dim holding the split dims' points (the image's split dims, or where
`points` followed them through reshapes and earlier reductions) would see the tile's
points alone. A ``sum`` or ``mean`` over every dim holding points is the domain's: the
tiles' sums added over the ranks (the gradient passes straight back to each tile, as a
global pooling's), a mean divided by the domain's count. ``x.mean()`` over the whole tile
is the domain's mean too; ``x.sum()`` is left as the tile's part of a loss (summed over the
ranks by ``backward``), and so are ``all``/``any``/``count_nonzero`` of the whole tile
(checks, with no gradient). An ``amax``/``amin`` over every dim holding points, and
``max()``/``min()`` of the whole tile, is the domain's largest or smallest value (its
gradient shared by every point equal to it, as torch's). Any other reduction along the
points raises (``max``/``min`` along a dim too: their indices would be the tile's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar.domain._forward.points import Points
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.sums import extreme_over_domain, over_domain

__all__ = ["loss_reduction", "reduce_tile", "refuse_mean_loss"]

_CONVERTED = frozenset({"sum", "mean"})
_TILE_PART = frozenset({"sum", "nansum", "all", "any", "count_nonzero"})
"""Of the whole tile: left as they are."""


def reduce_tile(ctx: DomainContext, func: Any, x: torch.Tensor, dims: frozenset[int],
                points: Points, image: bool, args: Sequence[Any], kwargs: dict[str, Any]
                ) -> torch.Tensor | None:
    """A reduction of the tile ``x`` along ``dims``, some holding ``points``.

    ``image``: ``x`` has the image's dims (its points where the image has them). Returns
    the domain's sum or mean, or ``None`` where the call runs on the tile as it is.

    Raises:
        ValueError: a reduction along the points that would see the tile's alone.
    """
    name = getattr(func, "__name__", str(func))
    whole = dims == frozenset(range(x.dim()))
    if whole and name in _TILE_PART:
        return None
    keepdim = bool(kwargs.get("keepdim", kwargs.get("keepdims",
                                                    args[2] if len(args) > 2 else False)))
    if name in _CONVERTED and points <= dims:
        return over_domain(ctx, x, sorted(dims), name, mean=name == "mean", image=image,
                           keepdim=keepdim, dtype=kwargs.get("dtype"))
    of_whole = name in ("max", "min") and whole and len(args) < 2 and not kwargs  # x.max()
    if points <= dims and (name in ("amax", "amin") or of_whole):
        return extreme_over_domain(ctx, x, sorted(dims), name, largest=name.endswith("max"),
                                   keepdim=keepdim)
    along = "the whole tile" if whole else f"dim(s) {sorted(points & dims)} of a tile"
    if name.startswith("fft_"):
        raise ValueError(
            f"{name} (domain-parallel) along {along}, which hold the split dims' points, "
            f"would transform the tile alone; tensorpar.context.distributed_fft2 computes a "
            f"2-D FFT over a split domain (neural operators' spectral layers are converted)")
    raise ValueError(
        f"{name} (domain-parallel) along {along}, which hold the split dims' points, would "
        f"see the tile's points alone; only a sum, a mean, an amax or an amin over every dim "
        f"holding them is converted (x.mean((2, 3)), x.sum((2, 3)), x.flatten(2).amax(-1), "
        f"x.mean(), x.max()), not indices. Compute it before the split, or over the "
        f"gathered tensor")


_LOSSES = frozenset({
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss"})
"""``torch.nn.functional``'s losses with a ``reduction``."""


def loss_reduction(func: Any, kwargs: dict[str, Any]) -> str | None:
    """A loss function's ``reduction`` (``None``: ``func`` is none of them).

    Read where given by name (``F.mse_loss(y, t, reduction="sum")``); the default is
    ``"mean"``.
    """
    if getattr(func, "__name__", "") not in _LOSSES or \
            getattr(func, "__module__", "") != "torch.nn.functional":
        return None
    return str(kwargs.get("reduction", "mean"))


def refuse_mean_loss(name: str) -> ValueError:
    """A loss averaged over a tile's points alone."""
    return ValueError(
        f"{name} (domain-parallel) with reduction='mean' of a tile would average the tile's "
        f"points alone; give reduction='sum' (the tile's part of a loss, summed over the "
        f"ranks by backward: divide it by the domain's count) or reduction='none' and take "
        f".mean() of it (the domain's mean)")


