"""all_to_all: the exchange's spec, its data paths and its autograd Function.

The public face is `tensorpar.collectives.functional.all_to_all`; everything it needs lives here.
A dim-0 exchange with ``sizes`` (token dispatch, the common case) is recognised first and
takes the shortest path; anything else builds an `AllToAllSpec`, from ``sizes`` or from
every rank's shape (one metadata exchange), so that every rank takes the same backend path.

The backend path (the equal-chunk collective, or split lists: the backend's own split-list
call for a dim-0 exchange, point to point on gloo otherwise) is chosen only from what every
rank knows alike. With ``sizes`` a rank cannot know that its
peers passed the same list, so it always takes the split-list path, even for equal chunks:
ranks whose ``sizes`` disagree then exchange the wrong amounts (which validation mode
reports) but can never wait in two different backend calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorpar.collectives._autograd import apply_or_run, needs_graph, tie_to_output
from tensorpar.collectives._entry import all_to_all_args
from tensorpar.collectives._meta import exchange, local_header
from tensorpar.collectives._split import NATIVE_DTYPES, as_bytes, balanced_sizes
from tensorpar.comm import _comm
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.comm._launch import SYNC, Launch
from tensorpar.errors import CollectiveArgumentError
from tensorpar.validation import check_all_to_all, check_backward, last_site

__all__ = ["AllToAllSpec", "run_all_to_all"]


def run_all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, group: GroupLike,
                   sizes: Sequence[int] | None) -> torch.Tensor:
    """`tensorpar.collectives.functional.all_to_all`, after its docstring."""
    fn = "all_to_all"
    g = resolve_group(group, fn)
    check_all_to_all(g, x, split_dim, concat_dim, sizes)
    if _dim0_exchange(x, split_dim, concat_dim, sizes, g.size):
        assert sizes is not None
        return all_to_all_dim0(x, sizes, g, SYNC, agreed=False)  # no graph, no spec
    tensor, sd, cd, checked = all_to_all_args(fn, x, split_dim, concat_dim, g, sizes)
    if g.is_single:
        return tensor
    spec, tensor = all_to_all_spec(fn, tensor, sd, cd, g, checked)
    return apply_or_run(_AllToAll, tensor, spec, SYNC)


def _dim0_exchange(x: object, split_dim: object, concat_dim: object,
                   sizes: Sequence[int] | None, n: int) -> bool:
    """Whether this is the common all-to-all, checked in one expression.

    That is: a non-empty tensor that needs no graph and has a dtype the backends move
    natively, split and concatenated along dim 0 into ``n`` ``sizes`` that are non-negative
    ints (not floats or bools) summing to its length. Anything else takes the general path,
    which also reports the mistakes. (Written without helper calls: it runs before every
    such exchange, and each Python call made right after a collective, with cold caches,
    costs microseconds.)
    """
    return (isinstance(x, torch.Tensor) and type(split_dim) is int is type(concat_dim)
            and split_dim == 0 == concat_dim and isinstance(sizes, (list, tuple))
            and 1 < len(sizes) == n and list(map(type, sizes)).count(int) == n
            and min(sizes) >= 0 and x.ndim > 0 and sum(sizes) == x.shape[0] > 0
            and x.dtype in NATIVE_DTYPES and not needs_graph(x))


@dataclass(frozen=True)
class AllToAllSpec:
    """What this rank sends (lengths along ``split_dim``) and receives (shapes per source)."""

    group: Group
    split_dim: int
    concat_dim: int
    send_sizes: tuple[int, ...]
    recv_shapes: tuple[torch.Size, ...]
    even: bool
    """Every rank sends and receives equal chunks, as learned from every rank's shape (the
    same on every rank: the ranks must agree on the equal-split path versus the split-list
    one). False whenever the split came from ``sizes``, which no rank can check."""

    @functools.cached_property
    def out_shape(self) -> torch.Size:
        """The concatenation of the received chunks."""
        shape = list(self.recv_shapes[0])
        shape[self.concat_dim] = sum(s[self.concat_dim] for s in self.recv_shapes)
        return torch.Size(shape)

    def dual(self, in_shape: torch.Size) -> AllToAllSpec:
        """The spec of the backward: gradients travel back the way the data came."""
        sent = []
        for n in self.send_sizes:
            shape = list(in_shape)
            shape[self.split_dim] = n
            sent.append(torch.Size(shape))
        return AllToAllSpec(self.group, self.concat_dim, self.split_dim,
                            tuple(s[self.concat_dim] for s in self.recv_shapes), tuple(sent),
                            self.even)


def all_to_all_spec(fn: str, x: torch.Tensor, sd: int, cd: int, g: Group,
                    sizes: tuple[int, ...] | None) -> tuple[AllToAllSpec, torch.Tensor]:
    """Send lengths and receive shapes, from ``sizes`` or from every rank's shape.

    Also returns this rank's autograd input: learned from every rank's metadata, it
    requires grad on every rank if it does on any, so that every rank joins the backward
    all-to-all (with ``sizes`` the ranks must agree, as validation mode checks).
    """
    if sizes is not None:  # every rank holds this shape: every received chunk is alike
        piece = list(x.shape)
        piece[sd] = sizes[g.rank]
        return AllToAllSpec(g, sd, cd, sizes, (torch.Size(piece),) * g.size, even=False), x
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
    if any(h.requires_grad for h in headers) and torch.is_grad_enabled() \
            and not x.requires_grad:  # another rank needs the backward: join it
        x = x.detach().requires_grad_()
    return AllToAllSpec(g, sd, cd, splits[g.rank], recv_all[g.rank], even), x


def all_to_all_dim0(x: torch.Tensor, sizes: Sequence[int], group: Group, launch: Launch,
                    agreed: bool) -> torch.Tensor:
    """The common all-to-all (e.g. token dispatch), with chunks leaving and landing in place.

    Every rank holds the same shape and sends ``sizes[r]`` rows along dim 0 to rank ``r``
    (the same ``sizes`` on every rank). ``x`` must have a dtype the backends move natively.
    ``agreed``: every rank is known to hold these ``sizes`` (learned from every rank's shape),
    so equal chunks may take the equal-split collective; otherwise the split-list path.
    """
    send = x.contiguous()
    n = group.size
    if agreed and sizes.count(sizes[0]) == n:  # equal chunks: the output has x's shape
        recv = torch.empty_like(send)
        launch.add(_comm.all_to_all(recv, send, None, None, group, launch.async_op), send)
        return recv
    mine = sizes[group.rank]
    recv = send.new_empty((mine * n, *send.shape[1:]))
    if send.ndim == 1:  # (the common case needs no flat views: each is a Python call)
        work = _comm.all_to_all(recv, send, [mine] * n, list(sizes), group, launch.async_op,
                                native=True)
    else:
        per_row = send.numel() // send.shape[0]
        work = _comm.all_to_all(recv.view(-1), send.view(-1), [mine * per_row] * n,
                                [k * per_row for k in sizes], group, launch.async_op,
                                native=True)
    if work is not None:
        launch.add(work, send)
    return recv


def all_to_all_data(x: torch.Tensor, spec: AllToAllSpec, launch: Launch) -> torch.Tensor:
    x = x.detach()
    if spec.split_dim == 0 == spec.concat_dim and spec.even and x.dtype in NATIVE_DTYPES:
        return all_to_all_dim0(x, spec.send_sizes, spec.group, launch, agreed=True)
    unit = 1 if x.dtype in NATIVE_DTYPES else x.element_size()  # as_bytes' elements per item
    if math.prod(x.shape[: spec.split_dim]) == 1:  # the parts are consecutive in memory
        send = x.contiguous()
        per_row = x.numel() // max(x.shape[spec.split_dim], 1)
        in_splits = [n * per_row for n in spec.send_sizes]
    else:
        parts = x.split(list(spec.send_sizes), spec.split_dim)
        send = torch.cat([p.reshape(-1) for p in parts])
        in_splits = [p.numel() for p in parts]
    out_numels = [math.prod(s) for s in spec.recv_shapes]
    out_shape = spec.out_shape
    lands_in_place = math.prod(out_shape[: spec.concat_dim]) == 1  # chunks arrive in order
    recv = x.new_empty(out_shape if lands_in_place else (sum(out_numels),))
    work = _comm.all_to_all(as_bytes(recv), as_bytes(send),
                            None if spec.even else [n * unit for n in out_numels],
                            None if spec.even else [n * unit for n in in_splits],
                            spec.group, launch.async_op,
                            native=spec.split_dim == 0 == spec.concat_dim)  # as all_to_all_dim0
    if lands_in_place:
        launch.add(work, send)
        return recv
    if work is not None:
        work.wait()
    pieces = recv.split(out_numels)
    return torch.cat([p.view(s) for p, s in zip(pieces, spec.recv_shapes, strict=True)],
                     spec.concat_dim)


class _AllToAll(torch.autograd.Function):
    data = staticmethod(all_to_all_data)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: AllToAllSpec, launch: Launch) -> torch.Tensor:
        ctx.spec, ctx.in_shape = spec, x.shape
        ctx.site = last_site(spec.group)  # for the backward's check
        out = all_to_all_data(x, spec, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        dual = ctx.spec.dual(ctx.in_shape)
        check_backward("all_to_all", ctx.spec.group, dual, site=ctx.site)
        return _AllToAll.apply(tie_to_output(grad, ctx), dual, SYNC), None, None
