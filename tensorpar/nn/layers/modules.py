"""Scatter / Gather as modules, for models whose input or output lives on one rank."""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.collectives.functional import gather, scatter
from tensorpar.comm._group import GroupLike
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["Gather", "Scatter"]


class Scatter(nn.Module):
    """`scatter` as a module (usable in ``nn.Sequential``).

    On ``src`` the input is the full tensor; on other ranks a placeholder or ``None``.

    Args:
        dim: the dimension to split.
        src: the source rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time).

    Example:
        >>> import torch
        >>> from tensorpar.nn import Gather, Scatter
        >>> model = torch.nn.Sequential(Scatter(dim=0), torch.nn.Linear(3, 2), Gather(dim=0))
        >>> model(torch.ones(4, 3)).shape   # one rank: every row stays here
        torch.Size([4, 2])
    """

    def __init__(self, dim: int = 0, src: int = 0, *, group: GroupLike = None) -> None:
        super().__init__()
        self.dim, self.src, self.group = dim, src, group

    def forward(self, x: torch.Tensor | TensorPlaceholder | None) -> torch.Tensor:
        """This rank's chunk of the tensor on ``src``."""
        return scatter(x, dim=self.dim, src=self.src, group=self.group)

    def extra_repr(self) -> str:
        """The dim and the root rank."""
        return f"dim={self.dim}, src={self.src}"


class Gather(nn.Module):
    """`gather` as a module: the full tensor on ``dst``, a placeholder elsewhere.

    Args:
        dim: the dimension to concatenate along.
        dst: the destination rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time).
    """

    def __init__(self, dim: int = 0, dst: int = 0, *, group: GroupLike = None) -> None:
        super().__init__()
        self.dim, self.dst, self.group = dim, dst, group

    def forward(self, x: torch.Tensor) -> torch.Tensor | TensorPlaceholder:
        """The concatenation on ``dst``, a placeholder elsewhere."""
        return gather(x, dim=self.dim, dst=self.dst, group=self.group)

    def extra_repr(self) -> str:
        """The dim and the root rank."""
        return f"dim={self.dim}, dst={self.dst}"
