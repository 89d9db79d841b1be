"""A parameter used after a global pooling gives a share of its gradient to the domain's sum.

Every parameter gradient of a domain-parallel model is summed over the domain (at the end
of the backward, in a data-parallel reducer's buckets, or in FSDP2's hybrid reduction). A
parameter used on the pooled, replicated features gets its whole gradient on every tile.
While a converted model runs, its functional-call conversion passes each parameter that a
call uses after the pooling through `_ScaleGrad`, which divides the gradient that reaches
the parameter by the number of tiles: the sum over the domain is then the whole gradient
once. Uses before the pooling (partial gradients) are left as they are, so a parameter used
on both sides gets both parts right, wherever it is used (a module's own parameter, one of
the model itself, an in-place op after it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tensorpar._torch import tree_map

__all__ = ["share_parameters"]


class _ScaleGrad(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def share_parameters(args: Any, kwargs: Any, tiles: int) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with every parameter that requires grad giving a share."""
    def share(value: Any) -> Any:
        if isinstance(value, nn.Parameter) and value.requires_grad:
            shared: torch.Tensor = _ScaleGrad.apply(value, 1.0 / tiles)  # type: ignore[no-untyped-call]
            return shared
        return value
    return tree_map(share, args), tree_map(share, kwargs)
