"""A parameter used on pooled features gives a share of its gradient to the domain's sum.

Every parameter gradient of a domain-parallel model is summed over the domain (at the end
of the backward, in a data-parallel reducer's buckets, or in FSDP2's hybrid reduction). A
parameter used on the pooled, replicated features gets its whole gradient on every tile.
While a converted model runs, its functional-call conversion passes each parameter that a
call on pooled features uses through `_ScaleGrad`, which divides the gradient that reaches
the parameter by the number of tiles: the sum over the domain is then the whole gradient
once. So does a tensor computed from parameters alone (a timestep embedding made at the
top, a logit scale), whose gradient reaches its parameters. Uses on tiles (partial
gradients) are left as they are, so a parameter used on both sides gets both parts right,
wherever it is used (a module's own parameter, one of the model itself, an in-place op
after it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorpar._torch import tree_map

__all__ = ["share_gradients"]


class _ScaleGrad(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def share_gradients(args: Any, kwargs: Any, tiles: int,
                    shares: Callable[[torch.Tensor], bool], in_place: bool = False
                    ) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with every tensor for which ``shares`` holds giving a share.

    Raises:
        ValueError: ``in_place`` and the tensor written into would give one (the share is a
            view, which an in-place write may not change).
    """
    if not torch.is_grad_enabled():
        return args, kwargs
    if in_place and args and isinstance(args[0], torch.Tensor) and shares(args[0]):
        raise ValueError(
            "a domain-parallel model writes pooled features in place into a tensor computed "
            "from parameters alone (or into a parameter): its gradient would be counted once "
            "per tile. Write out of place (y = y + pooled)")

    def share(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and shares(value):
            shared: torch.Tensor = _ScaleGrad.apply(value, 1.0 / tiles)  # type: ignore[no-untyped-call]
            return shared
        return value
    return tree_map(share, args), tree_map(share, kwargs)
