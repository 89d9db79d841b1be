"""Autograd-safe collectives with placeholders on the ranks that hold no data.

Public functions come first; the private ``torch.autograd.Function`` classes after them.
Every backward calls its dual Function's ``.apply``, so second-order gradients work.
``src``/``dst`` are always ranks **within** ``group``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar import _comm
from tensorpar._group import Group, GroupLike, resolve_group
from tensorpar._split import SplitSpec, as_bytes, balanced_sizes, check_sizes, check_total
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
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

__all__ = ["gather", "scatter"]


def scatter(x: torch.Tensor | TensorPlaceholder | None, dim: int = 0, src: int = 0,
            group: GroupLike = None, sizes: Sequence[int] | None = None,
            exchange_meta: bool = True) -> torch.Tensor:
    """Split ``x`` on rank ``src`` along ``dim`` and give every rank its chunk.

    Forward: scatter from ``src``. Backward: gather of the chunk gradients to ``src``.

    On ``src``, ``x`` is the full tensor. On every other rank ``x`` is a
    :class:`~tensorpar.TensorPlaceholder` or ``None``. By default the ranks exchange one
    small metadata header first: ranks that passed ``None`` learn the dtype, shape and
    ``requires_grad`` from it, ranks that passed a placeholder check it, and any mistake on
    any rank raises the same error on every rank (nobody is left waiting). When every
    non-source rank passes a placeholder, ``exchange_meta=False`` on every rank skips that
    exchange.

    Every rank's chunk has ``requires_grad`` equal to the source tensor's, so every rank
    takes part in the backward gather.

    Args:
        x: the full tensor on ``src``; a placeholder or ``None`` elsewhere.
        dim: the dimension to split (negative counts from the end).
        src: the source rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time), or a
            1-D ``DeviceMesh``.
        sizes: chunk length along ``dim`` for each rank (zeros allowed). Default: balanced
            like ``torch.tensor_split(x, group_size, dim)``.
        exchange_meta: exchange the metadata header (default). Pass ``False`` on every rank
            only when every non-source rank passes a correct placeholder.

    Returns:
        This rank's chunk: contiguous, the source's dtype, on this rank's device (the
        placeholder's, or the group's default device for ``None``).

    Raises:
        CollectiveArgumentError: bad ``sizes``/``dim`` for the source's shape, or a
            placeholder that disagrees with the source tensor (raised on every rank).
        CollectiveTypeError: a placeholder or ``None`` on ``src``, or a tensor on another
            rank (raised on every rank).
        ValueError: ``src`` is not a rank of the group, or ``sizes`` is malformed.

    Shape:
        ``x``: ``(*, L, *)`` with ``L`` at ``dim``; output: ``(*, sizes[rank], *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.scatter(torch.arange(6.0).view(3, 2), dim=-1)  # one rank: all of it
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
    """
    fn = "scatter"
    g = resolve_group(group, fn)
    g.check_rank(fn, "src", src)
    if sizes is not None:
        sizes = check_sizes(fn, sizes, g.size)
    if g.is_single:
        tensor = _single_rank_tensor(fn, x)
        d = _normalize_dim(fn, dim, tensor.ndim)
        if sizes is not None:
            check_total(fn, sizes, tensor.shape[d], d, "the source tensor")
        return tensor.contiguous()

    header = _scatter_source_header(fn, x, src, g, exchange_meta)
    d = _normalize_dim(fn, dim, len(header.shape))
    length = header.shape[d]
    if sizes is None:
        sizes = balanced_sizes(length, g.size)
    else:
        check_total(fn, sizes, length, d, "the source tensor")
    assert header.dtype is not None
    spec = SplitSpec(g, src, d, tuple(sizes), header.shape, header.dtype)
    requires_grad = header.requires_grad and torch.is_grad_enabled()
    if g.rank == src:
        assert isinstance(x, torch.Tensor)
        inp = x
    else:
        ph = x if isinstance(x, TensorPlaceholder) else None
        inp = _placeholder_input(ph, header.dtype, requires_grad, g)
    out: torch.Tensor = _Scatter.apply(inp, spec)  # type: ignore[no-untyped-call]
    return out


def gather(x: torch.Tensor, dim: int = 0, dst: int = 0, group: GroupLike = None,
           sizes: Sequence[int] | None = None) -> torch.Tensor | TensorPlaceholder:
    """Concatenate every rank's chunk along ``dim`` on rank ``dst``.

    Forward: gather to ``dst``. Backward: scatter of the gradient from ``dst``.

    Chunk lengths along ``dim`` may differ across ranks; they are discovered with one
    small metadata exchange, which also checks that dtypes and the other dims agree (a
    disagreement raises the same error on every rank). Passing ``sizes`` skips the exchange;
    the caller then guarantees that every rank agrees.

    Every rank other than ``dst`` gets a :class:`~tensorpar.TensorPlaceholder` with the full
    shape and ``owner=dst``. For the backward pass, ``dst`` computes a loss from the result
    and calls ``loss.backward()``; every other rank calls ``.backward()`` on its placeholder,
    which joins the backward scatter and delivers its chunk's gradient. One idiom serves
    every rank::

        out = tensorpar.gather(y, dst=0)
        loss = loss_fn(out) if not tensorpar.is_placeholder(out) else out
        loss.backward()

    Args:
        x: this rank's chunk (every rank passes a tensor, possibly of length 0 along ``dim``).
        dim: the dimension to concatenate along (negative counts from the end).
        dst: the destination rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time), or a
            1-D ``DeviceMesh``.
        sizes: every rank's chunk length along ``dim``, to skip the size exchange.

    Returns:
        The full tensor on ``dst``; a placeholder of it on every other rank.

    Raises:
        CollectiveArgumentError: chunks disagree in dtype, ndim or any dim but ``dim``, or
            ``dim`` is out of range (raised on every rank).
        CollectiveTypeError: a rank passed something that is not a tensor.
        ValueError: ``dst`` is not a rank of the group, or ``sizes`` is malformed or
            disagrees with this rank's chunk.

    Shape:
        ``x``: ``(*, L_rank, *)``; output on ``dst``: ``(*, sum(L), *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.gather(torch.ones(2, 3), dim=1)  # one rank: its chunk is everything
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    fn = "gather"
    g = resolve_group(group, fn)
    g.check_rank(fn, "dst", dst)
    if sizes is not None:
        sizes = check_sizes(fn, sizes, g.size)
    if g.is_single or sizes is not None:
        tensor = _single_rank_tensor(fn, x) if g.is_single else _local_tensor(fn, x)
        d = _normalize_dim(fn, dim, tensor.ndim)
        if g.is_single:
            if sizes is not None:
                check_total(fn, sizes, tensor.shape[d], d, "this rank's chunk")
            return tensor
        assert sizes is not None
        if tensor.shape[d] != sizes[g.rank]:
            raise ValueError(f"{fn}: sizes[{g.rank}]={sizes[g.rank]} but this rank's chunk has "
                             f"length {tensor.shape[d]} along dim {d}")
        requires_grad = tensor.requires_grad
    else:
        headers = _exchange(g, _local_header(x))
        d, sizes, requires_grad = _check_gather_headers(fn, headers, dim, g)
        tensor = x
    full = list(tensor.shape)
    full[d] = sum(sizes)
    spec = SplitSpec(g, dst, d, tuple(sizes), torch.Size(full), tensor.dtype)
    requires_grad = requires_grad and torch.is_grad_enabled()
    inp = tensor.detach().requires_grad_() if requires_grad and not tensor.requires_grad \
        else tensor
    out: torch.Tensor = _Gather.apply(inp, spec)  # type: ignore[no-untyped-call]
    if g.rank == dst:
        return out
    return TensorPlaceholder(spec.full_shape, tensor.dtype, device=tensor.device,
                             requires_grad=out.requires_grad, owner=dst, group=g.handle,
                             _anchor=out)


# ---------------------------------------------------------------------------------------
# argument checks and the metadata exchange
# ---------------------------------------------------------------------------------------

def _single_rank_tensor(fn: str, x: object) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    raise CollectiveTypeError(f"{fn}: on a group of one rank this rank is the source and must "
                              f"pass a tensor, got {_kind_name(x)}")


def _local_tensor(fn: str, x: object) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    raise CollectiveTypeError(f"{fn}: every rank must pass a tensor, got {_kind_name(x)}")


def _placeholder_input(x: TensorPlaceholder | None, dtype: torch.dtype, requires_grad: bool,
                       g: Group) -> torch.Tensor:
    """The autograd input standing for ``x`` on a rank without data.

    A placeholder produced by a differentiable collective carries its anchor in the graph:
    using it keeps ``gather -> placeholder -> scatter`` differentiable on this rank. Otherwise
    a fresh empty leaf keeps the rank in the graph when the source requires grad.
    """
    anchor = x._anchor if isinstance(x, TensorPlaceholder) else None
    if anchor is not None and anchor.requires_grad == requires_grad:
        return anchor
    device = x.device if isinstance(x, TensorPlaceholder) else g.comm_device()
    return torch.empty(0, dtype=dtype, device=device, requires_grad=requires_grad)


def _kind_name(x: object) -> str:
    if x is None:
        return "None"
    if isinstance(x, TensorPlaceholder):
        return "a TensorPlaceholder"
    return f"a {type(x).__name__}"


def _local_header(x: object) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return encode_header(KIND_TENSOR, x.shape, x.dtype,
                             x.requires_grad and torch.is_grad_enabled())
    if isinstance(x, TensorPlaceholder):
        return encode_header(KIND_PLACEHOLDER, x.shape, x.dtype, x.requires_grad)
    return encode_header(KIND_NONE if x is None else KIND_OTHER)


def _exchange(g: Group, header: torch.Tensor) -> list[Header]:
    """All-gather one header per rank (one collective) and decode them."""
    device = g.comm_device()
    out = torch.empty(g.size * HEADER_LEN, dtype=torch.int64, device=device)
    _comm.all_gather_into(out, header.to(device), g, purpose="meta")
    return [decode_header(row) for row in out.view(g.size, HEADER_LEN).cpu()]


def _scatter_source_header(fn: str, x: object, src: int, g: Group,
                           exchange_meta: bool) -> Header:
    """The source tensor's metadata, checked on every rank (or locally without exchange)."""
    if not exchange_meta:
        if g.rank == src:
            if not isinstance(x, torch.Tensor):
                raise CollectiveTypeError(f"{fn}(src={src}): the source rank must pass the "
                                          f"full tensor, got {_kind_name(x)}")
        elif not isinstance(x, TensorPlaceholder):
            raise CollectiveTypeError(
                f"{fn}(src={src}, exchange_meta=False): rank {g.rank} must pass a "
                f"TensorPlaceholder describing the source tensor, got {_kind_name(x)}")
        return decode_header(_local_header(x))

    headers = _exchange(g, _local_header(x))
    source = headers[src]
    if source.kind != KIND_TENSOR:
        got = "something that is not a tensor" if source.kind == KIND_OTHER else (
            "None" if source.kind == KIND_NONE else "a TensorPlaceholder")
        mine = f" ({_kind_name(x)})" if g.rank == src else ""
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
            mine = f" ({_kind_name(x)})" if g.rank == rank else ""
            raise CollectiveTypeError(f"{fn}(src={src}): rank {rank} passed something that is "
                                      f"neither a TensorPlaceholder nor None{mine}")
        if h.kind == KIND_PLACEHOLDER and h[1:] != source[1:]:
            raise CollectiveArgumentError(
                f"{fn}(src={src}): rank {rank}'s placeholder describes {h.describe()}, but the "
                f"source tensor is {source.describe()}")
    return source


def _check_gather_headers(fn: str, headers: list[Header], dim: int, g: Group
                          ) -> tuple[int, tuple[int, ...], bool]:
    """Validate every rank's chunk metadata; returns (dim, sizes, requires_grad)."""
    for rank, h in enumerate(headers):
        if h.kind != KIND_TENSOR:
            raise CollectiveTypeError(f"{fn}: every rank must pass a tensor, rank {rank} passed "
                                      f"{'None' if h.kind == KIND_NONE else 'a non-tensor'}")
    first = headers[0]
    try:
        d = _normalize_dim(fn, dim, len(first.shape))
    except (TypeError, ValueError) as e:
        raise CollectiveArgumentError(str(e)) from None
    for rank, h in enumerate(headers):
        other_dims = [s for i, s in enumerate(h.shape) if i != d]
        first_dims = [s for i, s in enumerate(first.shape) if i != d]
        if h.dtype != first.dtype or len(h.shape) != len(first.shape) or other_dims != first_dims:
            raise CollectiveArgumentError(
                f"{fn}(dim={dim}): chunks must agree in dtype and in every dim but {d}; "
                f"rank 0 has {first.describe()}, rank {rank} has {h.describe()}")
    return d, tuple(h.shape[d] for h in headers), any(h.requires_grad for h in headers)


# ---------------------------------------------------------------------------------------
# data movement (flat, padded to the largest chunk when chunks differ)
# ---------------------------------------------------------------------------------------

def _scatter_data(x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
    """Root: ``x`` is the full tensor. Others: ``x`` only supplies the device."""
    g, numels = spec.group, spec.numels
    mine = numels[g.rank]
    shape = spec.chunk_shape(g.rank)
    width = max(numels)
    if width == 0:
        return x.new_empty(shape, dtype=spec.dtype)
    recv = x.new_empty(width, dtype=spec.dtype)
    chunks: list[torch.Tensor] | None = None
    if spec.is_root:
        parts = x.detach().split(list(spec.sizes), spec.dim)
        if spec.is_even:
            chunks = [as_bytes(p.contiguous()) for p in parts]
        else:
            stage = x.new_empty((g.size, width), dtype=spec.dtype)
            for r, p in enumerate(parts):
                stage[r, : numels[r]].view(p.shape).copy_(p)
            chunks = [as_bytes(row) for row in stage]
    _comm.scatter(as_bytes(recv), chunks, spec.root, g)
    return recv[:mine].view(shape)


def _gather_data(chunk: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
    """Root: returns the full tensor. Others: returns an empty autograd anchor."""
    g, numels = spec.group, spec.numels
    width = max(numels)
    if width == 0:
        return chunk.new_empty(spec.full_shape if spec.is_root else (0,))
    send = chunk.detach().contiguous().view(-1)
    if not spec.is_even:
        send = torch.cat([send, send.new_empty(width - send.numel())])
    if not spec.is_root:
        _comm.gather(as_bytes(send), None, spec.root, g)
        return chunk.new_empty(0)
    direct = spec.is_even and spec.leading_is_one
    full = chunk.new_empty(spec.full_shape) if direct else chunk.new_empty((g.size, width))
    rows = full.view(g.size, width)
    _comm.gather(as_bytes(send), [as_bytes(row) for row in rows], spec.root, g)
    if direct:
        return full
    parts = [rows[r, : numels[r]].view(spec.chunk_shape(r)) for r in range(g.size)]
    return torch.cat(parts, spec.dim)


# ---------------------------------------------------------------------------------------
# autograd Functions: each backward is its dual's .apply
# ---------------------------------------------------------------------------------------

def _tie_to_output(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
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


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        out = _scatter_data(x, spec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Gather.apply(_tie_to_output(grad, ctx), ctx.spec), None  # type: ignore[no-untyped-call]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        out = _gather_data(x, spec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Scatter.apply(_tie_to_output(grad, ctx), ctx.spec), None  # type: ignore[no-untyped-call]
