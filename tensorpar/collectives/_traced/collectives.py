"""The public collectives and region mappings as ``torch.compile`` traces them.

Each public function checks first whether it runs inside a compiled function and, if so,
hands the call to `tensorpar.collectives._traced._dispatch.compiled_call`, which decides once
whether it traces: then it calls its namesake here. While dynamo traces, that is: the same
argument checks as eagerly (the functions of `tensorpar.collectives._entry`, plain Python
evaluated once at trace time), then the functional collectives of
`tensorpar.collectives._traced._prims`, which the compiled graph holds as ops. The rooted
collectives (scatter, gather, broadcast, reduce) are in `tensorpar.collectives._traced.rooted`.
A call that needs values only the ranks' data can tell (a metadata header exchange: chunk
lengths without ``sizes``), validation mode (a fingerprint exchange per call) and a call that
dynamo runs for real never come here: the public function runs eagerly between two graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar.collaborative import CollaborativeTensor
from tensorpar.collectives._entry import (
    all_to_all_args,
    reduction_args,
    resolve_args,
    split_args,
    tensor_args,
)
from tensorpar.collectives._meta import own_chunk, sole_chunk
from tensorpar.collectives._traced import _prims as P
from tensorpar.collectives._traced._dispatch import result as _result
from tensorpar.collectives._traced.rooted import broadcast, gather, reduce, scatter
from tensorpar.comm._group import GroupLike, resolve_group

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "copy_to_group",
           "gather", "gather_from_group", "reduce", "reduce_from_group", "reduce_scatter",
           "scatter", "split_to_group"]



def all_reduce(x: torch.Tensor, *, op: str = "sum", backward: str = "sum",
               group: GroupLike = None, async_op: bool = False, inplace: bool = False,
               algorithm: str = "flat", topology: Any = None
               ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.all_reduce`, traced (called with ``algorithm="flat"``)."""
    g, tensor, op_name = reduction_args("all_reduce", x, op, group, backward=backward,
                                        inplace=inplace)
    if g.is_single:
        return _result(tensor, async_op)
    name = P.group_name(g)
    source = tensor / g.size if op_name == "mean" else tensor
    if op_name in ("max", "min"):  # forward-only: its backward raises, as eagerly
        out = P.ForwardOnly.apply(source, "all_reduce", op_name, name)  # type: ignore[no-untyped-call]
    elif backward == "sum" and op_name == "mean":  # the gradient divided before its sum too
        out = P.ReduceIdentity.apply(  # type: ignore[no-untyped-call]
            P.CopyToGroup.apply(tensor, name) / g.size, name)  # type: ignore[no-untyped-call]
    elif backward == "sum":
        out = P.all_reduce_sum(source, name, op_name)
    else:
        out = P.ReduceIdentity.apply(source, name)  # type: ignore[no-untyped-call]
    if inplace:  # recorded by autograd (as eagerly: the gradient flows through the reduction)
        tensor.copy_(out)
        out = tensor
    return _result(out, async_op)


def all_gather(x: torch.Tensor, *, dim: int = 0, group: GroupLike = None,
               sizes: Sequence[int] | None = None, async_op: bool = False
               ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.all_gather`, traced (called with ``sizes``)."""
    fn = "all_gather"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim)
    assert checked is not None
    if g.is_single:
        return _result(sole_chunk(fn, x, dim, checked), async_op)
    tensor, d = own_chunk(fn, x, dim, g, checked)
    return _result(P.all_gather_dim(tensor, d, checked, P.group_name(g)), async_op)


def reduce_scatter(x: torch.Tensor, *, dim: int = 0, op: str = "sum", group: GroupLike = None,
                   sizes: Sequence[int] | None = None, async_op: bool = False
                   ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.reduce_scatter`, traced."""
    g, tensor, op_name, d, split = split_args("reduce_scatter", x, dim, group, sizes, op)
    assert op_name is not None  # an op was given
    if g.is_single:
        return _result(tensor, async_op)
    source = tensor / g.size if op_name == "mean" else tensor
    reduce_op = "sum" if op_name == "mean" else op_name
    if reduce_op in ("max", "min"):  # forward-only: its backward raises, as eagerly
        return _result(P.ForwardOnly.apply(  # type: ignore[no-untyped-call]
            source, "reduce_scatter", reduce_op, P.group_name(g), d, tuple(split), g.rank),
            async_op)
    return _result(P.reduce_scatter_dim(source, d, split, g.rank, P.group_name(g), reduce_op),
                   async_op)


def all_to_all(x: torch.Tensor, *, split_dim: int, concat_dim: int, group: GroupLike = None,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.all_to_all`, traced (called with ``sizes``)."""
    fn = "all_to_all"
    g = resolve_group(group, fn)
    tensor, sd, cd, checked = all_to_all_args(fn, x, split_dim, concat_dim, g, sizes)
    assert checked is not None
    if g.is_single:
        return tensor
    return P.all_to_all_dims(tensor, sd, cd, checked, g.rank, P.group_name(g))


def copy_to_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """`tensorpar.copy_to_group`, traced."""
    g, tensor = tensor_args("copy_to_group", x, group)
    if g.is_single:
        return tensor
    out: torch.Tensor = P.CopyToGroup.apply(tensor, P.group_name(g))  # type: ignore[no-untyped-call]
    return out


def reduce_from_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """`tensorpar.reduce_from_group`, traced."""
    g, tensor = tensor_args("reduce_from_group", x, group)
    if g.is_single:
        return tensor
    out: torch.Tensor = P.ReduceIdentity.apply(tensor, P.group_name(g))  # type: ignore[no-untyped-call]
    return out


def split_to_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.split_to_group`, traced."""
    g, tensor, _, d, split = split_args("split_to_group", x, dim, group, sizes)
    if g.is_single:
        return tensor
    out: torch.Tensor = P.SplitToGroup.apply(  # type: ignore[no-untyped-call]
        tensor, d, split, g.rank, P.group_name(g))
    return out


def gather_from_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.gather_from_group`, traced (called with ``sizes``)."""
    fn = "gather_from_group"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim)
    assert checked is not None
    if g.is_single:
        return sole_chunk(fn, x, dim, checked)
    tensor, d = own_chunk(fn, x, dim, g, checked)
    out: torch.Tensor = P.GatherFromGroup.apply(  # type: ignore[no-untyped-call]
        tensor, d, checked, g.rank, P.group_name(g))
    return out

