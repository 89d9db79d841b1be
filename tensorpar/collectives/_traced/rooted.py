"""The rooted collectives (scatter, gather, broadcast, reduce) as ``torch.compile`` traces them.

A rooted collective traces when every rank knows, at trace time and without asking its
peers, the shape of what travels and that every peer takes the traced path too:

- `scatter` and `broadcast` with ``exchange_meta=False``: the source passes the tensor and
  every other rank a `TensorPlaceholder`, whose metadata gives the shape and whose anchor
  (or an empty tensor) keeps the rank in the autograd graph. With the default
  ``exchange_meta=True`` a rank may pass ``None`` and learn the metadata from a header
  exchange, which only the ranks' data can answer: those calls run eagerly (one graph break
  each, on every rank alike: a rank cannot know whether a peer passed ``None``).
- `gather` with ``sizes=``: every rank knows every chunk's length. Without ``sizes`` the
  lengths come from a header exchange: eagerly, one graph break.
- `reduce`: always (every rank passes a tensor of the same shape).

The ranks but the root get a `TensorPlaceholder` of the result (a gather's or a reduce's),
built in the graph around the collective's anchor, so ``placeholder.backward()`` runs the
compiled backward. Validation mode runs them eagerly, as every collective.

They trace from torch 2.13 on (`TRACES`); on torch 2.11 the compiled graphs of the root and
of the other ranks issued their collectives differently and the ranks hung, so older torch
runs them eagerly (one graph break each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar.collaborative import CollaborativeTensor
from tensorpar.collectives._entry import reduction_args, resolve_args, source_chunk
from tensorpar.collectives._meta import (
    check_source,
    own_chunk,
    placeholder_input,
    sole_chunk,
    sole_input,
)
from tensorpar.collectives._rooted import placeholder_for
from tensorpar.collectives._split import sizes_or_balanced
from tensorpar.collectives._traced import _prims as P
from tensorpar.collectives._traced._dispatch import result
from tensorpar.comm._group import Group, GroupLike
from tensorpar.placeholder import TensorPlaceholder, _normalize_dim

__all__ = ["TRACES", "broadcast", "gather", "reduce", "scatter"]

TRACES = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)
"""Whether the rooted collectives trace with this torch (else they run eagerly)."""


def _anchor(ph: TensorPlaceholder, g: Group) -> torch.Tensor:
    """The autograd input standing for a placeholder on a rank without data (as eagerly)."""
    return placeholder_input(ph, ph.dtype, ph.requires_grad and torch.is_grad_enabled(), g)


def scatter(x: torch.Tensor | TensorPlaceholder | None, *, dim: int, src: int,
            group: GroupLike, sizes: Sequence[int] | None, exchange_meta: bool) -> torch.Tensor:
    """`tensorpar.scatter`, traced (called with ``exchange_meta=False``)."""
    fn = "scatter"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim, src=src)
    if g.is_single:
        return source_chunk(fn, x, dim, checked)
    meta = check_source(fn, x, src, g)  # the tensor on src, a placeholder elsewhere
    d = _normalize_dim(fn, dim, meta.ndim)
    split = sizes_or_balanced(fn, checked, meta.shape[d], d, g.size, "the source tensor")
    inp = meta if isinstance(meta, torch.Tensor) else _anchor(meta, g)
    chunk: torch.Tensor = P.Scatter.apply(  # type: ignore[no-untyped-call]
        inp, tuple(meta.shape), d, split, src, g.rank, P.group_name(g))
    return chunk


def gather(x: torch.Tensor, *, dim: int, dst: int, group: GroupLike,
           sizes: Sequence[int] | None) -> torch.Tensor | TensorPlaceholder:
    """`tensorpar.gather`, traced (called with ``sizes``)."""
    fn = "gather"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim, dst=dst)
    assert checked is not None
    if g.is_single:
        return sole_chunk(fn, x, dim, checked)
    tensor, d = own_chunk(fn, x, dim, g, checked)
    full: torch.Tensor = P.Gather.apply(  # type: ignore[no-untyped-call]
        tensor, d, checked, dst, g.rank, P.group_name(g))
    if g.rank == dst:
        return full
    shape = list(tensor.shape)
    shape[d] = sum(checked)
    return placeholder_for(full, shape, tensor.dtype, dst, g)


def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int, group: GroupLike,
              exchange_meta: bool, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.broadcast`, traced (called with ``exchange_meta=False``)."""
    fn = "broadcast"
    g, _ = resolve_args(fn, group, None, x=x, src=src)
    if g.is_single:
        return result(sole_input(fn, x), async_op)
    meta = check_source(fn, x, src, g)
    inp = meta if isinstance(meta, torch.Tensor) else _anchor(meta, g)
    got: torch.Tensor = P.Broadcast.apply(  # type: ignore[no-untyped-call]
        inp, tuple(meta.shape), meta.dtype, src, g.rank, P.group_name(g))
    return result(got, async_op)


def reduce(x: torch.Tensor, *, dst: int, op: str, group: GroupLike
           ) -> torch.Tensor | TensorPlaceholder:
    """`tensorpar.reduce`, traced."""
    g, tensor, op_name = reduction_args("reduce", x, op, group, dst=dst)
    if g.is_single:
        return tensor
    source = tensor / g.size if op_name == "mean" else tensor
    got: torch.Tensor = P.Reduce.apply(  # type: ignore[no-untyped-call]
        source, "sum" if op_name == "mean" else op_name, dst, g.rank, P.group_name(g))
    if g.rank == dst:
        return got
    return placeholder_for(got, tuple(tensor.shape), tensor.dtype, dst, g)
