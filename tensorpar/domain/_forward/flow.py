"""What a functional call makes of the marks it is given (see `tensorpar.domain._tiles.marks`).

The kind of a call's output from its inputs' (`output_kind`), the calls that read only a
tensor's metadata, the calls that are not linear in a loss of parts (`not_linear`), and
the errors where pooled features and tiles meet in a way that cannot be followed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorpar.domain._tiles.marks import (
    CHECKPOINTED,
    EARLY,
    POOLED,
    TILE,
    Kind,
    Marks,
    Scan,
    tensors_in,
)

__all__ = ["mixing_error", "not_linear", "output_kind", "reads_only_metadata",
           "refuse_checkpointed", "refuse_spread"]

_NOT_LINEAR = frozenset({
    "pow", "rpow", "ipow", "sqrt", "rsqrt", "log", "log2", "log10", "log1p", "exp", "exp2",
    "expm1", "sigmoid", "logsigmoid", "tanh", "relu", "gelu", "silu", "elu", "leaky_relu",
    "softplus", "hardtanh", "threshold", "abs", "square", "reciprocal", "clamp", "clamp_min",
    "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "max", "min", "amax", "amin",
    "sin", "cos", "tan", "sinh", "cosh", "atan", "atan2", "erf", "sign", "floor", "ceil",
    "round", "logaddexp", "logsumexp", "softmax", "log_softmax", "norm", "linalg_vector_norm",
    "where", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"})
"""Calls whose result for a part is not that part's share of the result for the whole."""


_PRODUCTS = frozenset({"mul", "rmul", "imul", "multiply", "matmul", "rmatmul", "outer",
                       "dot", "bmm", "mm", "einsum"})


_QUOTIENTS = frozenset({"div", "truediv", "itruediv", "divide", "true_divide", "floordiv"})


def output_kind(func: Any, args: Sequence[Any], scan: Scan, marks: Marks,
                reduced: bool) -> Kind | None:
    """The kind of a call's output, where tiles and pooled features do not both go in.

    A tensor argument that only gives a dtype, a device or a shape (``y.to(x)``,
    ``x.new_zeros(...)``) passes no mark on; ``torch.zeros_like(x)`` has ``x``'s shape and
    mark (a constant tile is a tile). What is made of neither tiles nor pooled features is
    early before the forward's first global pooling, and unmarked after it.
    """
    kind: Kind | None = None
    if POOLED in scan.kinds and TILE in scan.kinds:
        return None  # (a partial reduction of both: see `refuse_spread`)
    if reads_only_metadata(func):  # the first argument's shape (``_like``) or data (``to``)
        if not getattr(func, "__name__", "").startswith("new_") and args \
                and isinstance(args[0], torch.Tensor):
            kind = marks.kind_of(args[0])
    elif scan.kinds or scan.early:
        kind = scan.road
    return EARLY if kind is None and not reduced else kind


def refuse_spread(name: str, out: Any, scan: Scan, agree: Callable[[bool], bool]) -> None:
    """Tiles and pooled features meeting in a tile's partial reduction (a loss of both parts).

    Allowed where nothing is broadcast over the tile's points; refused where the pooled
    tensor is spread over more elements than it has. ``agree`` makes the verdict every
    rank's (an empty tile spreads nothing on its own rank).
    """
    spread = any(t.numel() > scan.pooled_numel for t in tensors_in(out))
    if agree(spread):
        raise mixing_error(name)


def reads_only_metadata(func: Any) -> bool:
    """Whether ``func`` reads only the dtype, device or shape of some tensor arguments.

    Of those after the first: ``y.to(x)``, ``y.type_as(x)``; of all: ``x.new_zeros``,
    ``torch.zeros_like(x)``.
    """
    name = getattr(func, "__name__", "")
    return name.startswith("new_") or name.endswith("_like") or name in ("to", "type_as")


def not_linear(func: Any, args: Sequence[Any], partial: Callable[[Any], bool]) -> bool:
    """Whether ``func`` of a loss of parts (`PARTIAL`) is not the sum of its parts' results.

    A non-linear function of it, a product of two parts, or a part as a divisor.
    ``partial(v)``: whether the argument ``v`` is such a loss.
    """
    name = getattr(func, "__name__", "").strip("_")
    if name in _NOT_LINEAR:
        return True
    parts = [partial(a) for a in args]
    if name in _PRODUCTS:
        return sum(parts) > 1
    if name in _QUOTIENTS:
        return len(parts) > 1 and parts[1]
    if name == "rtruediv" or name == "rdiv":  # ``2 / loss``: ``loss`` comes first
        return bool(parts) and parts[0]
    return False


def mixing_error(what: str) -> RuntimeError:
    """Pooled features and tiles meet in ``what`` in a way that cannot be followed."""
    return RuntimeError(
        f"{what} (domain-parallel) takes both tiles and features after a global pooling "
        f"(replicated on every rank), and the pooled operand is spread over the tile's points "
        f"in a way that is not followed: pooled features go back into the tiles where they "
        f"have size 1 along every split dim (a gate broadcast over the tile), or through "
        f"F.interpolate, expand or repeat to the tile's size")


def refuse_checkpointed(where: str, tensors: Any) -> None:
    """Raise where a tensor among ``tensors`` comes out of a reentrant activation checkpoint.

    ``torch.utils.checkpoint(..., use_reentrant=True)`` recomputes its part in the backward,
    outside the model's forward: there the tiles' exchanges and reductions are not
    converted, and the gradients came out wrong with no error.

    Raises:
        ValueError: on every rank alike (the graph's nodes are every rank's).
    """
    for t in tensors_in(tensors):
        if (node := t.grad_fn) is not None and type(node).__name__ == CHECKPOINTED:
            raise ValueError(
                f"{where} (domain-parallel) takes the output of an activation checkpoint "
                f"inside the model (torch.utils.checkpoint, use_reentrant=True): its backward "
                f"recomputes that part outside the model's forward, where the tiles' halo "
                f"exchanges and reductions are not converted, and its gradients would be "
                f"wrong. Activation checkpointing inside a domain-parallel model is not "
                f"supported (with use_reentrant=False the backward raises)")
