"""The row-parallel matmul, its all-reduce and its bias as one autograd Function.

``reduce_from_group(F.linear(x, W)) + b`` records three backward nodes and, on the way
forward, clones the matmul's output before reducing it (the public all-reduce never
overwrites its input). `_RowLinear` does the same arithmetic in one node: the matmul's output
is a fresh tensor nobody else holds, so it is all-reduced in place and the bias is added
to it in place, after the sum (adding it before would multiply it by the group size).
Its backward issues no collective (the all-reduce's adjoint is the identity for a
replicated consumer) and computes the input, weight and bias gradients in one go.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.collectives._autograd import direct_apply, torch_op
from tensorpar.collectives._symmetric import _CopyToGroup
from tensorpar.collectives.regions import reduce_from_group
from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.nn.layers._column_fn import save_linear_inputs, weight_grads
from tensorpar.nn.layers._path import LayerPath, autocast_on, layer_path

__all__ = ["row_linear", "wide_product"]

_SUM = torch_op("sum")


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               group: Group) -> torch.Tensor:
    """``reduce_from_group(F.linear(x, weight)) + bias``, in one Function where it can be.

    The composition runs where the Function does not apply (validation mode, autocast); where
    no graph is recorded (inference), the arithmetic runs without the Function.
    """
    path = layer_path(x, group)
    if path is LayerPath.FUSED:
        out: torch.Tensor = _apply_row(x, weight, bias, group)
        return out
    if path is LayerPath.NO_GRAPH:
        return row_linear_data(x, weight, bias, group)
    if path is LayerPath.SINGLE:
        return F.linear(x, weight, bias)
    # every region call fingerprinted, autocast's casts, or traced by torch.compile
    y = reduce_from_group(F.linear(x, weight), group=group)
    if bias is None:
        return y
    # under autocast the bias joins in the matmul's dtype (as in F.linear), else by promotion
    return y + (bias.to(y.dtype) if autocast_on(x.device.type) else bias)


def wide_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 wide: torch.dtype | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype] | None:
    """``F.linear(x, weight)`` and the bias in ``wide`` (a ``reduce_dtype``), and the output dtype.

    None where ``wide`` is what the layer computes in anyway. The dense layer rounds once,
    at its output. Under autocast it first rounds its inputs to autocast's dtype: so do
    these (the bias too), and the product is taken with autocast off, which would round it
    back before the sum.
    """
    if wide is None:
        return None
    low = _autocast_dtype(x.device.type)
    casts = low is not None and torch.float64 not in (x.dtype, weight.dtype)  # (as autocast)
    out = low if low is not None and casts else torch.promote_types(x.dtype, weight.dtype)
    if wide == out:
        return None

    def widened(t: torch.Tensor) -> torch.Tensor:
        return (t.to(low) if casts else t).to(wide)

    off = torch.autocast(x.device.type, enabled=False) if low is not None \
        else contextlib.nullcontext()
    with off:
        y = F.linear(widened(x), widened(weight))
    return y, None if bias is None else widened(bias), out


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``device_type``, else None."""
    try:
        on = torch.is_autocast_enabled(device_type)
        return torch.get_autocast_dtype(device_type) if on else None
    except (TypeError, RuntimeError, AttributeError):  # a device without autocast (meta)
        return None


def row_linear_data(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    group: Group) -> torch.Tensor:
    """The forward arithmetic: matmul, in-place all-reduce of its output, then the bias."""
    y = F.linear(x, weight)
    if not y.is_contiguous():  # every rank's bytes must be reduced in the same order
        y = y.contiguous()
    _comm.all_reduce(y, _SUM, group)
    if bias is None:
        return y
    return y.add_(bias) if bias.dtype == y.dtype else y + bias


class _RowLinear(torch.autograd.Function):
    """Forward: ``all_reduce(x W^T) + b``. Backward: ``g W``, ``g^T x``, ``sum(g)``, no comm."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Group) -> torch.Tensor:
        save_linear_inputs(ctx, x, weight, bias, group)
        return row_linear_data(x, weight, bias, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        bias_grad = grad
        if torch.is_grad_enabled():
            # create_graph: the matmul's gradient passes through the all-reduce's adjoint
            # (copy_to_group), whose own backward all-reduces: second-order gradients come
            # out as with the composition, on every rank (tied to x, as copy_to_group does)
            if x is not None:
                grad = grad + x.reshape(-1)[:0].sum()
            grad = _CopyToGroup.apply(grad, ctx.group)  # type: ignore[no-untyped-call]
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = weight_grads(ctx, grad, x, bias_grad)
        return grad_x, grad_w, grad_b, None


_apply_row = direct_apply(_RowLinear)
