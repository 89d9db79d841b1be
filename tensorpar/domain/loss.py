"""Reductions of a field over the whole domain without gathering it."""

from __future__ import annotations

import torch

from tensorpar.collectives.functional import all_reduce
from tensorpar.comm._group import GroupLike, resolve_group

__all__ = ["domain_mean"]


def domain_mean(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """The mean over every point of a tensor split over the domain, on every rank.

    Each rank passes its tile; every rank gets the dense tensor's mean (a replicated
    scalar), e.g. a mean-squared-error loss ``domain_mean((y - target) ** 2)``. Every rank
    calls ``backward()`` on it: each tile gets its own points' gradient (``1 / N``, the
    dense gradient's slice), and the converted model sums the parameter gradients.

    Forward: all-reduce of the tile sums and point counts. Backward: identity (the loss is
    replicated: each rank's gradient reaches its own tile only).

    Args:
        x: this rank's tile (any shape; may be empty).
        group: the domain's process group (``None``: the default group, resolved at call
            time), or a ``DeviceMesh`` of tiles (the mean is over all of its ranks).

    Returns:
        A 0-dim tensor: the mean over the whole domain (the same on every rank).

    Raises:
        ValueError: the domain has no points at all.

    Shape:
        x: any; output: ``()``.

    Example:
        >>> import torch
        >>> domain_mean(torch.tensor([1.0, 2.0, 6.0]))
        tensor(3.)
    """
    groups = []
    if type(group).__name__ == "DeviceMesh":
        mesh = group
        groups = [resolve_group(mesh.get_group(i), "domain_mean")  # type: ignore[union-attr]
                  for i in range(mesh.ndim)]  # type: ignore[union-attr]
    else:
        groups = [resolve_group(group, "domain_mean")]
    both = torch.stack([x.sum(), x.new_tensor(float(x.numel()))])
    for g in groups:
        if not g.is_single:
            both = all_reduce(both, backward="identity", group=g)
    if float(both[1].detach()) == 0:
        raise ValueError("domain_mean: the domain has no points (every tile is empty)")
    return both[0] / both[1].detach()
