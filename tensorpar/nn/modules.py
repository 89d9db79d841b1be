"""Scatter / Gather as modules, for models whose input or output lives on one rank."""

from __future__ import annotations

import torch
from torch import nn

from tensorpar._group import GroupLike
from tensorpar.functional import gather, scatter
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["Gather", "Scatter"]


class Scatter(nn.Module):
    """`scatter` as a module (usable in ``nn.Sequential``).

    On ``src`` the input is the full tensor; on other ranks a placeholder or ``None``.
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
    """`gather` as a module: the full tensor on ``dst``, a placeholder elsewhere."""

    def __init__(self, dim: int = 0, dst: int = 0, *, group: GroupLike = None) -> None:
        super().__init__()
        self.dim, self.dst, self.group = dim, dst, group

    def forward(self, x: torch.Tensor) -> torch.Tensor | TensorPlaceholder:
        """The concatenation on ``dst``, a placeholder elsewhere."""
        return gather(x, dim=self.dim, dst=self.dst, group=self.group)

    def extra_repr(self) -> str:
        """The dim and the root rank."""
        return f"dim={self.dim}, dst={self.dst}"
