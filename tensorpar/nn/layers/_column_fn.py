"""The column-parallel matmul with its backward all-reduce overlapped with the weight gradient.

``F.linear(copy_to_group(x), W, b)`` gives the right gradients, but autograd computes the
input and weight gradients of ``F.linear`` in one node, so the all-reduce of the input
gradient can only start after the weight gradient is done. `_ColumnLinear` computes the input
gradient first, launches its all-reduce asynchronously, computes the weight and bias
gradients while it travels, then waits: the same numbers, with the communication hidden
behind the weight gradient (Megatron's asynchronous tensor-parallel all-reduce).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.collectives._autograd import direct_apply, torch_op
from tensorpar.collectives._meta import require_tensor
from tensorpar.collectives._symmetric import _AllReduce
from tensorpar.collectives.regions import enter_region
from tensorpar.comm import _comm
from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import Group
from tensorpar.comm._launch import SYNC
from tensorpar.nn.layers._path import LayerPath, layer_path

__all__ = ["SharedInput", "column_linear", "save_linear_inputs", "weight_grads"]

_LABEL = "the input of a column-parallel layer: ColumnParallelLinear or ColumnParallelConv1D"


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  group: Group) -> torch.Tensor:
    """``F.linear(copy_to_group(x), weight, bias)``, with the overlapped backward.

    Falls back to the plain composition where the fused Function does not apply: a group
    of one rank, autocast (whose casts the composition handles), validation mode (where
    `copy_to_group` fingerprints the forward and backward calls) or ``torch.compile`` (which
    traces the composition). Where no graph is
    recorded (inference), ``copy_to_group`` is the identity: a plain ``F.linear``.
    """
    x = require_tensor("ColumnParallelLinear", x)
    path = layer_path(x, group)
    if path is LayerPath.FUSED:
        out: torch.Tensor = _apply_column(x, weight, bias, group)
        return out
    if path is LayerPath.COMPOSED:
        return F.linear(enter_region(x, group, _LABEL), weight, bias)
    return F.linear(x, weight, bias)  # one rank, or no graph: copy_to_group is the identity


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix: every leading dim folded into the rows (also for 0 columns)."""
    return t if t.ndim == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def save_linear_inputs(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, group: Group) -> None:
    """Save on ``ctx`` what a fused linear Function's backward needs, and only that.

    As ``F.linear`` does: a frozen weight saves no ``x``, a frozen input no weight.
    """
    ctx.group, ctx.has_bias = group, bias is not None
    need_x, need_w = ctx.needs_input_grad[:2]
    ctx.save_for_backward(x if need_w else None, weight if need_x else None)


def weight_grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor | None,
                 bias_grad: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``F.linear``'s weight and bias gradients, as far as ``ctx`` needs them.

    ``grad``: the gradient of the matmul's output; ``x``: the matmul's input (``None`` where
    the weight is frozen); ``bias_grad``: the gradient the bias sees, where it is not
    ``grad`` (a bias added after a reduction sees the gradient before its adjoint).
    """
    need_w, need_b = ctx.needs_input_grad[1:3]
    rows = _rows(grad)
    grad_w = rows.t().matmul(_rows(x)) if need_w and x is not None else None
    if not (need_b and ctx.has_bias):
        return grad_w, None
    return grad_w, (rows if bias_grad is None else _rows(bias_grad)).sum(0)


class _ColumnLinear(torch.autograd.Function):
    """Forward: ``x W^T + b``. Backward: ``all_reduce(g W)`` overlapped with ``g^T x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Group) -> torch.Tensor:
        save_linear_inputs(ctx, x, weight, bias, group)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        # create_graph: every step must be differentiable, so no asynchronous launch
        differentiable = torch.is_grad_enabled()
        if differentiable and x is not None:  # as CopyToGroup does: reach x on every rank
            grad = grad + x.reshape(-1)[:0].sum()
        grad_x = work = None
        if need_x and differentiable:
            grad_x = _AllReduce.apply(grad.matmul(weight), ctx.group, "sum", "identity", False,
                                     SYNC)
        elif need_x:
            grad_x = grad.matmul(weight)  # a fresh, contiguous tensor: reduced in place
            work = _comm.all_reduce(grad_x, torch_op("sum"), ctx.group, async_op=True)
        grad_w, grad_b = weight_grads(ctx, grad, x)  # while grad_x travels
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


_apply_column = direct_apply(_ColumnLinear)


class SharedInput:
    """One backward all-reduce for column-parallel layers that read the same input.

    Layers such as an attention block's q/k/v projections, or an MLP's gate and up
    projections, each need the all-reduce of their input gradient; when they read the same
    tensor, the sum of their input gradients can be all-reduced once instead (Megatron gets
    this by fusing the layers). Layers given one `SharedInput` pass their input through
    `copy`: the first call makes ``copy_to_group(x)``, and later calls with the same tensor,
    unmodified, get that same copy, whose backward then sees the summed gradient. A
    different input simply gets a copy of its own. `tensorpar.parallelize` gives one to the
    column-parallel children of each module and clears it when that module's forward ends,
    so no copy outlives the forward pass that made it.
    """

    def __init__(self) -> None:
        self._input: weakref.ReferenceType[torch.Tensor] | None = None
        self._copy: torch.Tensor | None = None
        self._version = -1
        self._traced_input: torch.Tensor | None = None

    def copy(self, x: torch.Tensor, group: Group) -> torch.Tensor:
        """``copy_to_group(x)``, made once per input tensor and version."""
        if compiling():  # compiled: one copy per input object
            return self._traced_copy(x, group)
        if self._copy is not None and self._input is not None and self._input() is x \
                and x._version == self._version:
            return self._copy
        copied = enter_region(x, group, _LABEL)
        self._input, self._copy, self._version = weakref.ref(x), copied, x._version
        return copied

    def _traced_copy(self, x: torch.Tensor, group: Group) -> torch.Tensor:
        # while dynamo traces, the input is compared by identity alone (a traced tensor has
        # no version counter to read); the forward hook's `clear` forgets it as eagerly
        if self._copy is not None and self._traced_input is x:
            return self._copy
        copied = enter_region(x, group, _LABEL)
        self._traced_input, self._copy = x, copied
        return copied

    def clear(self, *hook_args: object) -> None:
        """Forget the last copy (a forward hook: takes and ignores the hook's arguments)."""
        self._input, self._copy, self._version = None, None, -1
        self._traced_input = None

    def __getstate__(self) -> dict[str, Any]:  # (weak references do not pickle)
        return {"_input": None, "_copy": None, "_version": -1, "_traced_input": None}
