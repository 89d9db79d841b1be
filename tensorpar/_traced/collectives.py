"""The public collectives and region mappings as ``torch.compile`` traces them.

Each public function checks first whether it runs inside a compiled function (dynamo traces
it, or runs it for real because it skipped the frame) and then calls its namesake here. While
dynamo traces, that is: the same argument checks (plain Python, evaluated once at trace
time), then the functional collectives of `tensorpar._traced._prims`, which the compiled
graph holds as ops. What needs values only the ranks' data can tell (a metadata header
exchange: chunk lengths without ``sizes``, who holds data in a rooted collective) and
validation mode (a fingerprint exchange per call) run eagerly instead, through `eager`,
which dynamo sees as one graph break. So does a call that dynamo runs for real inside a
compiled function (a frame it skipped): `eager` keeps dynamo out of tensorpar's eager
internals, which talk to the process group directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.compiler import is_compiling

from tensorpar._autograd import Launch, check_op
from tensorpar._entry import resolve_args
from tensorpar._group import Group, GroupLike
from tensorpar._meta import require_tensor, sole_chunk
from tensorpar._split import sizes_or_balanced
from tensorpar._switch import VALIDATE
from tensorpar._symmetric import check_all_reduce_args
from tensorpar._traced import _prims as P
from tensorpar.collaborative import CollaborativeTensor
from tensorpar.placeholder import TensorPlaceholder, _normalize_dim

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "copy_to_group", "eager",
           "gather", "gather_from_group", "reduce", "reduce_from_group", "reduce_scatter",
           "scatter", "split_to_group"]

_PUBLIC = {"all_gather": "tensorpar.functional", "all_reduce": "tensorpar.functional",
           "all_to_all": "tensorpar.functional", "broadcast": "tensorpar.functional",
           "gather": "tensorpar.functional", "reduce": "tensorpar.functional",
           "reduce_scatter": "tensorpar.functional", "scatter": "tensorpar.functional",
           "copy_to_group": "tensorpar.regions", "gather_from_group": "tensorpar.regions",
           "reduce_from_group": "tensorpar.regions", "split_to_group": "tensorpar.regions"}


@torch.compiler.disable  # type: ignore[untyped-decorator]
def eager(fn: str, *args: Any, **kwargs: Any) -> Any:
    """Run the public collective ``fn`` eagerly: dynamo breaks the graph around this call.

    Inside it ``torch.compiler.is_compiling()`` is False, so the public function takes its
    eager path (header exchanges, validation's fingerprints, placeholders).
    """
    return getattr(importlib.import_module(_PUBLIC[fn]), fn)(*args, **kwargs)


def scatter(x: torch.Tensor | TensorPlaceholder | None, *, dim: int, src: int,
            group: GroupLike, sizes: Sequence[int] | None, exchange_meta: bool) -> torch.Tensor:
    """`tensorpar.scatter`: eagerly (a rank without data learns the metadata from a header)."""
    out: torch.Tensor = eager("scatter", x, dim=dim, src=src, group=group, sizes=sizes,
                              exchange_meta=exchange_meta)
    return out


def gather(x: torch.Tensor, *, dim: int, dst: int, group: GroupLike,
           sizes: Sequence[int] | None) -> torch.Tensor | TensorPlaceholder:
    """`tensorpar.gather`: eagerly (the ranks but ``dst`` get a placeholder)."""
    out: torch.Tensor | TensorPlaceholder = eager("gather", x, dim=dim, dst=dst, group=group,
                                                  sizes=sizes)
    return out


def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int, group: GroupLike,
              exchange_meta: bool, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.broadcast`: eagerly (as `scatter`)."""
    out: torch.Tensor | CollaborativeTensor = eager("broadcast", x, src=src, group=group,
                                                    exchange_meta=exchange_meta,
                                                    async_op=async_op)
    return out


def reduce(x: torch.Tensor, *, dst: int, op: str, group: GroupLike
           ) -> torch.Tensor | TensorPlaceholder:
    """`tensorpar.reduce`: eagerly (the ranks but ``dst`` get a placeholder)."""
    out: torch.Tensor | TensorPlaceholder = eager("reduce", x, dst=dst, op=op, group=group)
    return out


def _result(out: torch.Tensor, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    # the wait is already in the graph (wait_tensor), where the compiler may move it
    return CollaborativeTensor(out, Launch(False)) if async_op else out


def all_reduce(x: torch.Tensor, *, op: str = "sum", backward: str = "sum",
               group: GroupLike = None, async_op: bool = False, inplace: bool = False,
               algorithm: str = "flat", topology: Any = None
               ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.all_reduce`, traced (the hierarchical algorithms run eagerly)."""
    if VALIDATE[0] or algorithm != "flat" or not is_compiling():
        return eager("all_reduce", x, op=op, backward=backward, group=group,  # type: ignore[no-any-return]
                     async_op=async_op, inplace=inplace, algorithm=algorithm, topology=topology)
    fn = "all_reduce"
    g, _ = resolve_args(fn, group, None, x=x, op=op, backward=backward)
    tensor = require_tensor(fn, x)
    op_name = check_op(fn, op, tensor, g)
    check_all_reduce_args(fn, tensor, backward, inplace)
    if g.is_single:
        return _result(tensor, async_op)
    name = P.group_name(g)
    source = tensor / g.size if op_name == "mean" else tensor
    if op_name in ("max", "min") or backward == "sum":
        out = P.all_reduce_sum(source, name, "sum" if op_name == "mean" else op_name)
    else:
        out = P.ReduceIdentity.apply(source, name)  # type: ignore[no-untyped-call]
    if inplace:
        with torch.no_grad():
            tensor.copy_(out)
        out = tensor
    return _result(out, async_op)


def all_gather(x: torch.Tensor, *, dim: int = 0, group: GroupLike = None,
               sizes: Sequence[int] | None = None, async_op: bool = False
               ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.all_gather`, traced when ``sizes`` is given (else one graph break)."""
    if VALIDATE[0] or sizes is None or not is_compiling():
        return eager("all_gather", x, dim=dim, group=group, sizes=sizes,  # type: ignore[no-any-return]
                     async_op=async_op)
    fn = "all_gather"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim)
    assert checked is not None
    tensor = _chunk(fn, x, dim, g, checked)
    if g.is_single:
        return _result(tensor, async_op)
    d = _normalize_dim(fn, dim, tensor.ndim)
    assert checked is not None
    return _result(P.all_gather_dim(tensor, d, checked, P.group_name(g)), async_op)


def reduce_scatter(x: torch.Tensor, *, dim: int = 0, op: str = "sum", group: GroupLike = None,
                   sizes: Sequence[int] | None = None, async_op: bool = False
                   ) -> torch.Tensor | CollaborativeTensor:
    """`tensorpar.reduce_scatter`, traced."""
    if VALIDATE[0] or not is_compiling():
        return eager("reduce_scatter", x, dim=dim, op=op, group=group,  # type: ignore[no-any-return]
                     sizes=sizes, async_op=async_op)
    fn = "reduce_scatter"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim, op=op)
    tensor = require_tensor(fn, x)
    op_name = check_op(fn, op, tensor, g)
    d = _normalize_dim(fn, dim, tensor.ndim)
    split = sizes_or_balanced(fn, checked, tensor.shape[d], d, g.size, "the input")
    if g.is_single:
        return _result(tensor, async_op)
    source = tensor / g.size if op_name == "mean" else tensor
    reduce_op = "sum" if op_name == "mean" else op_name
    return _result(P.reduce_scatter_dim(source, d, split, g.rank, P.group_name(g), reduce_op),
                   async_op)


def all_to_all(x: torch.Tensor, *, split_dim: int, concat_dim: int, group: GroupLike = None,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.all_to_all`, traced when ``sizes`` is given (else one graph break)."""
    if VALIDATE[0] or sizes is None or not is_compiling():
        return eager("all_to_all", x, split_dim=split_dim,  # type: ignore[no-any-return]
                     concat_dim=concat_dim, group=group, sizes=sizes)
    fn = "all_to_all"
    g, checked = resolve_args(fn, group, sizes)
    tensor = require_tensor(fn, x)
    sd = _normalize_dim(fn, split_dim, tensor.ndim)
    cd = _normalize_dim(fn, concat_dim, tensor.ndim)
    assert checked is not None
    sizes_or_balanced(fn, checked, tensor.shape[sd], sd, g.size, "this rank's tensor")
    if g.is_single:
        return tensor
    return P.all_to_all_dims(tensor, sd, cd, checked, g.rank, P.group_name(g))


def copy_to_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """`tensorpar.copy_to_group`, traced."""
    if VALIDATE[0] or not is_compiling():
        return eager("copy_to_group", x, group=group)  # type: ignore[no-any-return]
    fn = "copy_to_group"
    g, _ = resolve_args(fn, group, None, x=x)
    tensor = require_tensor(fn, x)
    if g.is_single:
        return tensor
    out: torch.Tensor = P.CopyToGroup.apply(tensor, P.group_name(g))  # type: ignore[no-untyped-call]
    return out


def reduce_from_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """`tensorpar.reduce_from_group`, traced."""
    if VALIDATE[0] or not is_compiling():
        return eager("reduce_from_group", x, group=group)  # type: ignore[no-any-return]
    fn = "reduce_from_group"
    g, _ = resolve_args(fn, group, None, x=x)
    tensor = require_tensor(fn, x)
    if g.is_single:
        return tensor
    out: torch.Tensor = P.ReduceIdentity.apply(tensor, P.group_name(g))  # type: ignore[no-untyped-call]
    return out


def split_to_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.split_to_group`, traced."""
    if VALIDATE[0] or not is_compiling():
        return eager("split_to_group", x, dim=dim, group=group,  # type: ignore[no-any-return]
                     sizes=sizes)
    fn = "split_to_group"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim)
    tensor = require_tensor(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    split = sizes_or_balanced(fn, checked, tensor.shape[d], d, g.size, "the input")
    if g.is_single:
        return tensor
    out: torch.Tensor = P.SplitToGroup.apply(  # type: ignore[no-untyped-call]
        tensor, d, split, g.rank, P.group_name(g))
    return out


def gather_from_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`tensorpar.gather_from_group`, traced when ``sizes`` is given (else one graph break)."""
    if VALIDATE[0] or sizes is None or not is_compiling():
        return eager("gather_from_group", x, dim=dim, group=group,  # type: ignore[no-any-return]
                     sizes=sizes)
    fn = "gather_from_group"
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim)
    assert checked is not None
    tensor = _chunk(fn, x, dim, g, checked)
    if g.is_single:
        return tensor
    assert checked is not None
    d = _normalize_dim(fn, dim, tensor.ndim)
    out: torch.Tensor = P.GatherFromGroup.apply(  # type: ignore[no-untyped-call]
        tensor, d, checked, g.rank, P.group_name(g))
    return out


def _chunk(fn: str, x: object, dim: int, g: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """This rank's chunk, checked against its entry of ``sizes`` (as the eager path does)."""
    if g.is_single:
        return sole_chunk(fn, x, dim, sizes)
    tensor = require_tensor(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    if tensor.shape[d] != sizes[g.rank]:
        raise ValueError(f"{fn}: sizes[{g.rank}]={sizes[g.rank]} but this rank's chunk has "
                         f"length {tensor.shape[d]} along dim {d}")
    return tensor
