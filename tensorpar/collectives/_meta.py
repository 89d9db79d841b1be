"""Metadata exchange and cross-rank validation shared by the collectives.

A collective whose ranks may disagree (who holds data, chunk shapes) first all-gathers one
fixed-size int64 header per rank. Every rank then sees every header and runs the same
checks, so a mistake on one rank raises the same error on all of them: nobody is left
waiting in the data collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar.collectives._split import SplitSpec, check_total
from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError, ranks_by_value
from tensorpar.placeholder import (
    HEADER_LEN,
    KIND_NONE,
    KIND_OTHER,
    KIND_PLACEHOLDER,
    KIND_TENSOR,
    Header,
    TensorPlaceholder,
    _normalize_dim,
    decode_header,
    encode_header,
)
from tensorpar.validation.calls import code_of

__all__ = ["check_roots", "check_same_call", "check_source", "chunks_spec", "exchange",
           "exchange_call", "local_header",
           "own_chunk", "placeholder_input", "require_tensor", "sole_chunk",
           "sole_input", "source_header"]


def kind_name(x: object) -> str:
    """How an argument is described in error messages."""
    if x is None:
        return "None"
    if isinstance(x, TensorPlaceholder):
        return "a TensorPlaceholder"
    return f"a {type(x).__name__}"


def require_tensor(fn: str, x: object, why: str = "every rank must pass a tensor") -> torch.Tensor:
    """``x`` if it is a tensor, else a `CollectiveTypeError` (raised locally)."""
    if isinstance(x, torch.Tensor):
        return x
    raise CollectiveTypeError(f"{fn}: {why}, got {kind_name(x)}")


def sole_input(fn: str, x: object) -> torch.Tensor:
    """The input on a one-rank group, where this rank is every root and must hold data."""
    return require_tensor(fn, x, "on a group of one rank this rank is the source and must "
                                 "pass a tensor")


def sole_chunk(fn: str, x: object, dim: int, sizes: Sequence[int] | None) -> torch.Tensor:
    """The input of a one-rank concatenation, checked against ``dim`` and ``sizes``."""
    tensor = sole_input(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    if sizes is not None:
        check_total(fn, sizes, tensor.shape[d], d, "this rank's chunk")
    return tensor


def local_header(x: object, root: int = -1) -> torch.Tensor:
    """This rank's header: the metadata of ``x``, what kind of object it is, and ``root``."""
    if isinstance(x, torch.Tensor):
        return encode_header(KIND_TENSOR, x.shape, x.dtype,
                             x.requires_grad and torch.is_grad_enabled(),
                             device_type=x.device.type, root=root)
    if isinstance(x, TensorPlaceholder):
        return encode_header(KIND_PLACEHOLDER, x.shape, x.dtype, x.requires_grad,
                             device_type=x.device.type, root=root)
    return encode_header(KIND_NONE if x is None else KIND_OTHER, root=root)


def check_roots(fn: str, name: str, headers: Sequence[Header]) -> None:
    """Raise on every rank if the ranks named different roots (``src``/``dst``)."""
    roots = [h.root for h in headers]
    if roots.count(roots[0]) != len(roots):
        raise CollectiveArgumentError(
            f"{fn}: the ranks disagree on {name} (a rank within the group): "
            + ranks_by_value(roots, lambda r: f"{name}={r}" if r != -1 else f"no {name} "
                             f"(called a collective without one)"))


def exchange(g: Group, header: torch.Tensor) -> list[Header]:
    """All-gather one header per rank (one collective) and decode them."""
    return [decode_header(torch.tensor(row)) for row in _comm.exchange_ints(g, header)]


def exchange_call(g: Group, header: torch.Tensor, dim: int, sizes: Sequence[int] | None
                  ) -> tuple[list[Header], list[int], list[int]]:
    """`exchange` with this rank's ``dim`` and ``sizes`` riding on the header.

    Two more int64s per rank whatever the group's size (`code_of`: a dim that is not an
    int becomes a hash, out of every range; ``sizes`` a hash, -1 for none). Returns every
    rank's header and those two codes (see `check_same_call`).
    """
    row = [code_of(dim), -1 if sizes is None else code_of(list(sizes))]
    rows = _comm.exchange_ints(g, torch.cat([header, torch.tensor(row, dtype=torch.int64)]))
    return ([decode_header(torch.tensor(row[:HEADER_LEN])) for row in rows],
            [row[HEADER_LEN] for row in rows], [row[HEADER_LEN + 1] for row in rows])


def check_same_call(fn: str, g: Group, ndim: int, dims: Sequence[int], codes: Sequence[int],
                    sizes: Sequence[int] | None) -> None:
    """Raise on every rank if the ranks gave other ``dim``s or ``sizes``.

    ``dim`` is compared once normalised for ``ndim`` dimensions; each rank would otherwise
    cut or size the chunks its own way. Where the ``sizes`` differ, every rank (all see
    it) exchanges them once more, so that the error shows them, the same on every rank.
    """
    normal = [d % ndim if -ndim <= d < ndim else None for d in dims]
    if normal.count(normal[0]) != len(normal):
        raise CollectiveArgumentError(
            f"{fn}: the ranks disagree on dim (for a {ndim}-d tensor): "
            + ranks_by_value(dims, lambda d: f"dim={d}"))
    if codes.count(codes[0]) != len(codes):
        mine = [0] * (1 + g.size) if sizes is None else [1, *sizes]  # (g.size entries each)
        shown = [str(row[1:]) if row[0] else "none" for row in _comm.exchange_ints(g, mine)]
        raise CollectiveArgumentError(f"{fn}: the ranks disagree on sizes: "
                                      f"{ranks_by_value(shown)}; every rank must pass the "
                                      f"same sizes")


def check_source(fn: str, x: object, src: int, g: Group) -> torch.Tensor | TensorPlaceholder:
    """A rooted collective's argument without a metadata exchange (``exchange_meta=False``).

    The full tensor on ``src``, a `TensorPlaceholder` elsewhere; each rank checks its own.
    """
    if g.rank == src:
        return require_tensor(f"{fn}(src={src})", x, "the source rank must pass the full tensor")
    if not isinstance(x, TensorPlaceholder):
        raise CollectiveTypeError(
            f"{fn}(src={src}, exchange_meta=False): rank {g.rank} must pass a "
            f"TensorPlaceholder describing the source tensor, got {kind_name(x)}")
    return x


def own_chunk(fn: str, x: object, dim: int, g: Group, sizes: Sequence[int]
              ) -> tuple[torch.Tensor, int]:
    """This rank's chunk of a concatenation and its normalised dim, checked against ``sizes``."""
    tensor = require_tensor(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    if tensor.shape[d] != sizes[g.rank]:
        raise CollectiveArgumentError(
            f"{fn}: sizes[{g.rank}]={sizes[g.rank]} but this rank's chunk has "
            f"length {tensor.shape[d]} along dim {d}")
    return tensor, d


def source_header(fn: str, x: object, src: int, g: Group, exchange_meta: bool,
                  dim: int = 0, sizes: Sequence[int] | None = None) -> Header:
    """The source tensor's metadata for a rooted collective (scatter, broadcast).

    With ``exchange_meta`` every rank learns it and checks every rank's argument (``dim``
    and ``sizes`` too); without, each rank checks only its own argument (a placeholder is
    then required off the source).
    """
    if not exchange_meta:
        check_source(fn, x, src, g)
        return decode_header(local_header(x))

    headers, dims, codes = exchange_call(g, local_header(x, src), dim, sizes)
    check_roots(fn, "src", headers)
    source = headers[src]
    if source.kind != KIND_TENSOR:
        got = {KIND_OTHER: "something that is not a tensor", KIND_NONE: "None",
               KIND_PLACEHOLDER: "a TensorPlaceholder"}[source.kind]
        mine = f" ({kind_name(x)})" if g.rank == src else ""
        raise CollectiveTypeError(f"{fn}(src={src}): the source rank must pass the full "
                                  f"tensor, got {got}{mine}")
    for rank, h in enumerate(headers):
        if rank == src:
            continue
        if h.kind == KIND_TENSOR:
            raise CollectiveTypeError(
                f"{fn}(src={src}): rank {rank} passed a tensor, but only the source rank holds "
                f"data; pass a TensorPlaceholder (or None) on rank {rank}")
        if h.kind == KIND_OTHER:
            mine = f" ({kind_name(x)})" if g.rank == rank else ""
            raise CollectiveTypeError(f"{fn}(src={src}): rank {rank} passed something that is "
                                      f"neither a TensorPlaceholder nor None{mine}")
        if h.kind == KIND_PLACEHOLDER and not h.describes_the_same(source):
            raise CollectiveArgumentError(
                f"{fn}(src={src}): rank {rank}'s placeholder describes {h.describe()}, but the "
                f"source tensor is {source.describe()}")
    check_same_call(fn, g, len(source.shape), dims, codes, sizes)
    return source


def chunk_headers(fn: str, x: object, dim: int, g: Group, root: int = -1
                  ) -> tuple[int, list[Header]]:
    """Exchange every rank's tensor metadata and check they can be concatenated along ``dim``.

    Returns the normalised dim and every rank's header. Dtype, ndim, every dim but
    ``dim`` and ``root`` (a gather's ``dst``; ``-1`` for none) must agree.
    """
    headers, dims, codes = exchange_call(g, local_header(x, root), dim, None)
    check_roots(fn, "dst", headers)
    for rank, h in enumerate(headers):
        if h.kind != KIND_TENSOR:
            raise CollectiveTypeError(f"{fn}: every rank must pass a tensor, rank {rank} passed "
                                      f"{'None' if h.kind == KIND_NONE else 'a non-tensor'}")
    first = headers[0]
    check_same_call(fn, g, len(first.shape), dims, codes, None)
    try:
        d = _normalize_dim(fn, dim, len(first.shape))
    except (TypeError, ValueError) as e:
        raise CollectiveArgumentError(str(e)) from None
    for rank, h in enumerate(headers):
        mismatch = h.dtype != first.dtype or len(h.shape) != len(first.shape) or any(
            a != b for i, (a, b) in enumerate(zip(h.shape, first.shape, strict=False)) if i != d)
        if mismatch:
            raise CollectiveArgumentError(
                f"{fn}(dim={dim}): every rank's tensor must agree in dtype and in every dim but "
                f"{d}; rank 0 has {first.describe()}, rank {rank} has {h.describe()}")
    return d, headers


def chunks_spec(fn: str, x: object, dim: int, g: Group, sizes: tuple[int, ...] | None,
                root: int) -> tuple[SplitSpec, torch.Tensor]:
    """The spec of a concatenation of every rank's chunk, and this rank's autograd input.

    Without ``sizes`` the chunk lengths (and a mistake on any rank) are learned from one
    header exchange; ``requires_grad`` is then True on every rank if it is on any.
    """
    if sizes is not None:
        tensor, d = own_chunk(fn, x, dim, g, sizes)
        requires_grad = tensor.requires_grad
    else:
        d, headers = chunk_headers(fn, x, dim, g, root)
        sizes = tuple(h.shape[d] for h in headers)
        requires_grad = any(h.requires_grad for h in headers)
        tensor = require_tensor(fn, x)  # checked on every rank by the exchange
    full = list(tensor.shape)
    full[d] = sum(sizes)
    spec = SplitSpec(group=g, root=root, full_shape=torch.Size(full), dtype=tensor.dtype,
                     dim=d, sizes=sizes)
    if requires_grad and torch.is_grad_enabled() and not tensor.requires_grad:
        # another rank's chunk needs a gradient: this rank must join the backward too
        tensor = tensor.detach().requires_grad_()
    return spec, tensor


def placeholder_input(x: TensorPlaceholder | None, dtype: torch.dtype, requires_grad: bool,
                      g: Group, device_type: str | None = None) -> torch.Tensor:
    """The autograd input standing for ``x`` on a rank without data.

    A placeholder produced by a differentiable collective carries its anchor in the graph:
    using it keeps ``gather -> placeholder -> scatter`` differentiable on this rank. Otherwise
    a fresh empty leaf keeps the rank in the graph when the source requires grad.

    Its device is where this rank receives: the placeholder's; without one, this rank's
    current device of the source's type (``device_type``, from the metadata header); without
    that either, the group's communication device.
    """
    anchor = x._anchor if isinstance(x, TensorPlaceholder) else None
    if anchor is not None and anchor.requires_grad == requires_grad:
        return anchor
    if isinstance(x, TensorPlaceholder):
        device = x.device
    elif device_type is not None:
        device = torch.device(device_type)  # no index: this rank's current device
    else:
        device = g.comm_device()
    return torch.empty(0, dtype=dtype, device=device, requires_grad=requires_grad)
