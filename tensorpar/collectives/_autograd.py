"""Pieces shared by the autograd Functions: reduce ops, async launches, double-backward ties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.distributed as dist

from tensorpar._torch import FUNCTORCH_ACTIVE, UNWRAP_IF_DEAD
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError, TensorparError

__all__ = ["apply_or_run", "backend_of", "check_op", "check_reducible",
           "direct_apply", "needs_graph", "scale_for_mean", "tie_to_output", "torch_op"]

REDUCE_OPS = ("sum", "mean", "max", "min")


def check_op(fn: str, op: object, x: torch.Tensor | None = None, group: Group | None = None
             ) -> str:
    """Validate a reduction: ``op`` is ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    With ``x``, also that ``op`` suits its dtype, and with ``group`` that the group's backend
    can reduce that dtype (`check_reducible`). Every check is local and every rank passes
    the same dtype, so every rank raises together, before any communication.
    """
    if op not in REDUCE_OPS:
        raise CollectiveArgumentError(
            f"{fn}: op={op!r} is not supported; expected one of {REDUCE_OPS}")
    if x is None:
        return str(op)
    dtype = x.dtype
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        raise CollectiveArgumentError(
            f"{fn}: op='mean' needs a floating point dtype, got {dtype}")
    if dtype not in _REDUCIBLE_EVERYWHERE and group is not None:  # the rare dtypes only
        check_reducible(fn, str(op), x, group)
    return str(op)


# every backend reduces these (the hot path checks nothing more)
_REDUCIBLE_EVERYWHERE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.uint8, torch.int32, torch.int64})
# What gloo reduces, found by reducing every dtype of the wire format on a gloo group:
# it refuses int16, uint16/32/64 and float8 ("Invalid scalar type"); complex only sums.
_GLOO_REDUCES = _REDUCIBLE_EVERYWHERE | {torch.bool, torch.complex64, torch.complex128,
                                        torch.complex32}


def check_reducible(fn: str, op: str, x: torch.Tensor, group: Group) -> None:
    """Raise `CollectiveTypeError` if ``group``'s backend cannot reduce ``x`` with ``op``.

    Raises:
        CollectiveTypeError: a complex dtype with ``op="max"``/``"min"`` (on every backend),
            or a dtype the backend refuses to reduce (gloo: int16, uint16/32/64, float8).
    """
    dtype = str(x.dtype).removeprefix("torch.")
    if x.dtype.is_complex and op in ("max", "min"):
        raise CollectiveTypeError(f"{fn}: op={op!r} compares values, which complex numbers "
                                  f"cannot be; got a {dtype} tensor. Use op='sum' or 'mean'")
    backend = backend_of(group, x.device.type)
    if backend == "gloo" and x.dtype not in _GLOO_REDUCES:
        raise CollectiveTypeError(
            f"{fn}: the gloo backend cannot reduce {dtype} tensors (op={op!r}); it reduces "
            f"float32/64, float16, bfloat16, int8, uint8, int32, int64, bool and complex "
            f"(sum only). It moves {dtype} (broadcast, scatter, gather, all_gather, "
            f"all_to_all); to reduce, convert first, e.g. x.to(torch.int64) or "
            f"x.to(torch.float32)")


def backend_of(group: Group, device_type: str) -> str | None:
    """The name of the backend ``group`` uses for tensors on ``device_type`` (``None``: none)."""
    handle = group.handle
    if handle is None:
        return None
    try:
        spec = str(dist.get_backend(handle))  # "gloo", or "cpu:gloo,cuda:nccl"
    except (RuntimeError, ValueError):
        return None
    for part in spec.split(","):
        device, _, name = part.rpartition(":")
        if not device or device == device_type:
            return name
    return None


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN} if dist.is_available() else {}


def torch_op(op: str) -> Any:
    """The ``ReduceOp`` that implements ``op`` (a mean is a sum of pre-divided inputs)."""
    return _TORCH_OPS[op]


def scale_for_mean(t: torch.Tensor, op: str, size: int) -> torch.Tensor:
    """``t / size`` for ``op="mean"`` (divide before reducing: no fp16 overflow), else ``t``."""
    return t / size if op == "mean" else t


def needs_graph(t: torch.Tensor) -> bool:
    """Whether an autograd Function applied to ``t`` would record a backward node.

    When it would not, the public collectives call the data path directly and skip
    ``Function.apply`` (tens of microseconds a call). Inside a forward-mode AD level the
    Function is kept, so a dual tensor is refused instead of losing its tangent.
    """
    # _current_level: the innermost forward-mode AD level, -1 for none (0, i.e. "maybe",
    # where torch does not say). One expression: this runs on every collective call.
    return ((t.requires_grad and torch.is_grad_enabled())
            or getattr(_forward_ad, "_current_level", 0) >= 0)


def apply_or_run(function: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """Apply a collective Function where autograd would record a node, else run its data path.

    ``function.apply(x, *args)`` or ``function.data(x, *args)``: the same result, without
    the Function machinery (tens of microseconds) when no graph is recorded. Every Function
    the public API may call without a graph defines ``data`` with the arguments of its
    ``forward`` (less ``ctx``).
    """
    out: torch.Tensor = function.apply(x, *args) if needs_graph(x) else function.data(x, *args)
    return out



def direct_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` for Functions whose arguments are tensors, ``None`` and plain values.

    ``Function.apply`` is a Python layer around the C++ ``apply``: it checks whether a
    functorch transform (``vmap``, ``grad``, ...) is active and, when none is, unwraps dead
    functorch wrappers and calls the C++ ``apply``. The function returned here does the
    same in fewer steps (about a microsecond less per call, which counts for the layers'
    Functions, applied on every forward); under a functorch transform, or on a torch that
    lacks these internals, it is ``function.apply`` itself. ``function`` must not define
    ``setup_context`` (whose default arguments ``Function.apply`` binds).
    """
    base = super(torch.autograd.Function, function).apply  # type: ignore[misc]  # the C++ apply
    active, unwrap = FUNCTORCH_ACTIVE, UNWRAP_IF_DEAD
    if active is None or unwrap is None or "setup_context" in vars(function):
        return function.apply

    def apply(*args: Any) -> Any:
        if active():
            return function.apply(*args)
        return base(*[unwrap(a) if isinstance(a, torch.Tensor) else a for a in args])

    return apply


def no_backward(fn: str, op: str) -> TensorparError:
    """The error for differentiating through a reduction that has no gradient here."""
    return TensorparError(f"{fn}(op={op!r}) is forward-only: a max/min reduction has no "
                          f"gradient here. Detach its input, or use op='sum'/'mean'.")


def tie_to_output(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Make a double-backward graph depend on this Function's forward output, on every rank.

    In a second-order backward the rank that owns the data may reach the forward node
    through its own computation (``out ** 3``) while the other ranks cannot: they would issue
    fewer collectives and hang. Adding an exact zero derived from the output (an empty
    slice summed, so no NaN/inf leaks in) makes every rank traverse it. Only done when a
    graph of the backward is being built (``create_graph=True``).
    """
    if not torch.is_grad_enabled():
        return grad
    out: torch.Tensor = ctx.saved_tensors[0]
    return grad + out.reshape(-1)[:0].sum()
