"""Argument handling shared by the public collectives in `functional`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar._autograd import Launch
from tensorpar._group import Group, GroupLike, resolve_group
from tensorpar._meta import chunk_headers, exchange, local_header, placeholder_input, require_tensor
from tensorpar._split import RootSpec, SplitSpec, balanced_sizes, check_sizes, check_total
from tensorpar._symmetric import AllToAllSpec
from tensorpar.collaborative import CollaborativeTensor
from tensorpar.errors import CollectiveArgumentError
from tensorpar.placeholder import Header, TensorPlaceholder, _normalize_dim


def setup(fn: str, group: GroupLike, sizes: Sequence[int] | None, **ranks: int
          ) -> tuple[Group, tuple[int, ...] | None]:
    """Resolve ``group``, check the rank arguments (group ranks) and the form of ``sizes``."""
    g = resolve_group(group, fn)
    for name, value in ranks.items():
        g.check_rank(fn, name, value)
    return g, None if sizes is None else check_sizes(fn, sizes, g.size)


def single(fn: str, x: object) -> torch.Tensor:
    """The input on a one-rank group, where this rank is every root and must hold data."""
    return require_tensor(fn, x, "on a group of one rank this rank is the source and must "
                                 "pass a tensor")


def single_chunk(fn: str, x: object, dim: int, sizes: tuple[int, ...] | None) -> torch.Tensor:
    """The input of a one-rank concatenation, checked against ``dim`` and ``sizes``."""
    tensor = single(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    if sizes is not None:
        check_total(fn, sizes, tensor.shape[d], d, "this rank's chunk")
    return tensor


def sizes_or_balanced(fn: str, sizes: tuple[int, ...] | None, length: int, dim: int, g: Group,
                      what: str) -> tuple[int, ...]:
    """``sizes`` checked against ``length``, or the balanced split of ``length``."""
    if sizes is None:
        return balanced_sizes(length, g.size)
    check_total(fn, sizes, length, dim, what)
    return sizes


def result(out: torch.Tensor, launch: Launch, async_op: bool
           ) -> torch.Tensor | CollaborativeTensor:
    """The tensor, or with ``async_op`` a handle that must be resolved first."""
    return CollaborativeTensor(out, launch) if async_op else out


def root_input(x: object, root: int, g: Group, header: Header) -> torch.Tensor:
    """The autograd input of a rooted Function: the tensor on the root, an anchor elsewhere
    (described by the source's ``header``)."""
    if g.rank == root:
        assert isinstance(x, torch.Tensor)
        return x
    ph = x if isinstance(x, TensorPlaceholder) else None
    assert header.dtype is not None
    return placeholder_input(ph, header.dtype, header.requires_grad and torch.is_grad_enabled(),
                             g, header.device_type)


def chunks_spec(fn: str, x: object, dim: int, g: Group, sizes: tuple[int, ...] | None,
                 root: int) -> tuple[SplitSpec, torch.Tensor]:
    """The spec of a concatenation of every rank's chunk, and this rank's autograd input.

    Without ``sizes`` the chunk lengths (and a mistake on any rank) are learned from one
    header exchange; ``requires_grad`` is then True on every rank if it is on any.
    """
    if sizes is not None:
        tensor = require_tensor(fn, x)
        d = _normalize_dim(fn, dim, tensor.ndim)
        if tensor.shape[d] != sizes[g.rank]:
            raise ValueError(f"{fn}: sizes[{g.rank}]={sizes[g.rank]} but this rank's chunk has "
                             f"length {tensor.shape[d]} along dim {d}")
        requires_grad = tensor.requires_grad
    else:
        d, headers = chunk_headers(fn, x, dim, g)
        sizes = tuple(h.shape[d] for h in headers)
        requires_grad = any(h.requires_grad for h in headers)
        assert isinstance(x, torch.Tensor)
        tensor = x
    full = list(tensor.shape)
    full[d] = sum(sizes)
    spec = SplitSpec(group=g, root=root, full_shape=torch.Size(full), dtype=tensor.dtype,
                     dim=d, sizes=sizes)
    if requires_grad and torch.is_grad_enabled() and not tensor.requires_grad:
        # another rank's chunk needs a gradient: this rank must join the backward too
        tensor = tensor.detach().requires_grad_()
    return spec, tensor


def placeholder_of(anchor: torch.Tensor, spec: RootSpec) -> TensorPlaceholder:
    """The placeholder a non-root rank gets, carrying the collective's autograd anchor."""
    return TensorPlaceholder(spec.full_shape, spec.dtype, device=anchor.device,
                             requires_grad=anchor.requires_grad, owner=spec.root,
                             group=spec.group.handle, _anchor=anchor)


def all_to_all_spec(fn: str, x: torch.Tensor, sd: int, cd: int, g: Group,
                     sizes: tuple[int, ...] | None) -> AllToAllSpec:
    """Send lengths and receive shapes, from ``sizes`` or from every rank's shape."""
    if sizes is not None:  # every rank holds this shape: every received chunk is alike
        piece = list(x.shape)
        piece[sd] = sizes[g.rank]
        return AllToAllSpec(g, sd, cd, sizes, (torch.Size(piece),) * g.size,
                            even=len(set(sizes)) == 1)
    headers = exchange(g, local_header(x))
    shapes = [h.shape for h in headers]
    if any(h.dtype != x.dtype or len(h.shape) != x.ndim for h in headers):
        raise CollectiveArgumentError(
            f"{fn}: every rank must pass a tensor of the same dtype and ndim; got "
            + ", ".join(f"rank {r}: {h.describe()}" for r, h in enumerate(headers)))
    splits = [balanced_sizes(s[sd], g.size) for s in shapes]
    recv_all = []
    for dst in range(g.size):  # every rank checks every rank's receive, so all raise together
        recv = []
        for src, shape in enumerate(shapes):
            piece = list(shape)
            piece[sd] = splits[src][dst]
            recv.append(torch.Size(piece))
        for src, got in enumerate(recv):
            if [n for i, n in enumerate(got) if i != cd] != \
                    [n for i, n in enumerate(recv[0]) if i != cd]:
                raise CollectiveArgumentError(
                    f"{fn}(split_dim={sd}, concat_dim={cd}): rank {dst} would receive chunks of "
                    f"shapes {list(recv[0])} (from rank 0) and {list(got)} (from rank {src}), "
                    f"which differ outside concat_dim")
        recv_all.append(tuple(recv))
    # even on every rank only if every rank splits the same shape evenly (decided from every
    # rank's shape, so all ranks take the same gloo path)
    even = all(s == shapes[0] for s in shapes) and len(set(splits[0])) == 1
    return AllToAllSpec(g, sd, cd, splits[g.rank], recv_all[g.rank], even)
