"""The parallel layers' fused Functions as ``torch.compile`` traces them.

Eagerly, `ColumnParallelLinear` and `RowParallelLinear` run one hand-written autograd
Function each (the backward all-reduce overlapped with the weight gradient; the forward
all-reduce in place). Compiled, the same arithmetic is written as the plain composition
(``F.linear`` around the region mappings, which trace): the compiler derives the backward and
schedules the collectives around the matmuls itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.collectives import regions
from tensorpar.comm._group import Group

__all__ = ["column_linear", "row_linear"]


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  group: Group) -> torch.Tensor:
    """``F.linear(copy_to_group(x), weight, bias)``; ``group`` has more than one rank."""
    return F.linear(regions.copy_to_group(x, group=group), weight, bias)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               group: Group) -> torch.Tensor:
    """``reduce_from_group(F.linear(x, weight)) + bias``; ``group`` has more than one rank."""
    y = regions.reduce_from_group(F.linear(x, weight), group=group)
    return y if bias is None else y + bias
