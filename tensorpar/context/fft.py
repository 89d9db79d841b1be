"""Distributed 2-D FFTs of a field split along one of its two dims.

The transform along the split dim needs every rank's rows, so the data is transposed with
an all-to-all (split the other dim, gather the split one), transformed, and transposed
back. `tensorpar.all_to_all` carries uneven tiles (it exchanges the shapes) and its
backward is the all-to-all with the dims swapped; ``torch.fft`` is differentiable; so the
whole is autograd-safe with the mirrored communication in the backward.

- `distributed_fft2`: ``fft2`` / ``ifft2``, the result split like the input.
- `distributed_rfft2_apply`: a real field through ``rfft2``, a function of the spectrum
  (applied in the transposed layout, between the two all-to-alls) and ``irfft2``: the
  spectral convolution of a Fourier neural operator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from tensorpar.collectives._traced._dispatch import between_graphs
from tensorpar.collectives.functional import all_gather, all_to_all
from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError

__all__ = ["distributed_fft2", "distributed_rfft2_apply"]

Norm = Literal["backward", "ortho", "forward"] | None

SpectrumFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``fn(spectrum, start)``: the spectrum's columns start at kept column ``start``."""


def _fft(t: torch.Tensor, dim: int, norm: Norm, inverse: bool) -> torch.Tensor:
    if t.numel() == 0:  # a rank with no rows (the FFT libraries refuse empty batches)
        _probe(torch.fft.ifft if inverse else torch.fft.fft, t, norm)
        return t.to(torch.promote_types(t.dtype, torch.complex64)) * 1
    out: torch.Tensor = (torch.fft.ifft if inverse else torch.fft.fft)(t, dim=dim, norm=norm)
    return out


def _probe(transform: Callable[..., torch.Tensor], t: torch.Tensor, norm: Norm) -> None:
    """Run ``transform`` on two points of ``t``'s dtype (an empty tile's stand-in).

    The empty tile refuses what torch refuses on its peers' tiles (a dtype, a norm) before
    any rank reaches an exchange.
    """
    transform(torch.zeros(2, dtype=t.dtype, device=t.device), norm=norm)


def _dims(fn: str, x: torch.Tensor, split_dim: int, other_dim: int) -> tuple[int, int]:
    for d in (split_dim, other_dim):
        if not -x.ndim <= d < x.ndim:
            raise IndexError(f"{fn}: dimension out of range (expected to be in range of "
                             f"[{-x.ndim}, {x.ndim - 1}], but got {d})")
    s, o = split_dim % x.ndim, other_dim % x.ndim
    if s == o:
        raise ValueError(f"{fn}: split_dim={split_dim} and other_dim={other_dim} are the same "
                         f"dim of a {x.ndim}-D tensor; expected two dims")
    return s, o


_NORMS = ("backward", "ortho", "forward")  # (None is "backward")
_SETTINGS = ("norm", "inverse", "length of other_dim", "columns kept", "split_dim",
             "other_dim", "number of dims")


def _rows(fn: str, x: torch.Tensor, s: int, o: int, g: Group, sizes: Sequence[int] | None,
          norm: Norm, inverse: bool = False, keep: int = 0,
          problem: Exception | None = None) -> list[int]:
    """Every rank's rows along ``s`` (one small all-gather unless ``sizes`` is given).

    The exchange also carries the call's settings, and whether this rank's arguments were
    good (``problem``: the error they raised here). Ranks that disagree on the settings
    would each run their own transform's steps through the same exchanges (wrong values,
    no error), and a rank that raised alone would leave its peers waiting in them: every
    rank raises instead (``problem`` on its own rank).
    """
    if sizes is None:
        good = problem is None
        settings = [_NORMS.index(norm or "backward") if norm in (None, *_NORMS) else -1,
                    int(inverse), x.shape[o], keep, s, o, x.dim()] if good else [0] * 7
        meta = all_gather(torch.tensor([[int(good), x.shape[s] if good else 0, *settings]],
                                       device=g.comm_device(x.device)),
                          group=g, sizes=[1] * g.size).tolist()
        if problem is not None:
            raise problem
        bad = [r for r, m in enumerate(meta) if not m[0]]
        if bad:
            raise CollectiveArgumentError(f"{fn}: rank(s) {bad} of the group got bad "
                                          f"arguments (their own error says which)")
        for i, name in enumerate(_SETTINGS, 2):
            values = [m[i] for m in meta]
            if len(set(values)) > 1:
                shown = [_NORMS[v] for v in values] if name == "norm" else values
                raise CollectiveArgumentError(f"{fn}: the ranks disagree on the {name}: "
                                              f"{shown} (rank order); expected one value")
        rows = [m[1] for m in meta]
    else:
        if problem is not None:
            raise problem
        rows = [int(n) for n in sizes]
        if len(rows) != g.size or rows[g.rank] != x.shape[s]:
            raise ValueError(f"{fn}: sizes={list(sizes)} must give every rank's rows "
                             f"({g.size} entries) and this rank's {x.shape[s]} at index "
                             f"{g.rank}")
    _refuse_no_points(fn, sum(rows))
    return rows


def _refuse_no_points(fn: str, total: int) -> None:
    """Raise where the field has no rows at all (as torch.fft refuses a transform of none)."""
    if not total:
        raise RuntimeError(f"{fn}: every rank's tile is empty: a transform over 0 points "
                           f"along split_dim")


def _to_columns(y: torch.Tensor, s: int, o: int, g: Group) -> torch.Tensor:
    """``(.., N_r, .., M)`` -> ``(.., N, .., M'/W)``: rows gathered, columns split.

    The columns are cut in equal tiles (``M'``: ``M`` zero-padded to a multiple of ``W``),
    so every rank's block has one shape; rank ``r`` gets columns ``[r M'/W, (r+1) M'/W)``.
    """
    width = y.shape[o]
    padded = -(-width // g.size) * g.size
    if padded != width:
        pad = list(y.shape)
        pad[o] = padded - width
        y = torch.cat([y, y.new_zeros(pad)], dim=o)
    return all_to_all(y, split_dim=o, concat_dim=s, group=g)


def _to_rows(y: torch.Tensor, s: int, o: int, g: Group, rows: Sequence[int], width: int
             ) -> torch.Tensor:
    """The inverse of `_to_columns`: each rank's own rows back, ``width`` columns."""
    y = all_to_all(y, split_dim=s, concat_dim=o, group=g, sizes=rows)
    return y.narrow(o, 0, width)


def distributed_fft2(x: torch.Tensor, *, split_dim: int, other_dim: int, group: GroupLike = None,
                     norm: Norm = None, inverse: bool = False) -> torch.Tensor:
    """``torch.fft.fft2`` over ``(split_dim, other_dim)`` of a tensor split along ``split_dim``.

    Each rank holds a contiguous tile of rows along ``split_dim``, in rank order, of any
    length (0 included). The result is split the same way (each rank gets the rows of its
    own tile back).

    Forward: all-to-all (split ``other_dim`` in equal tiles, zero-padded; gather
    ``split_dim``), then back (split ``split_dim`` at the original tiles). Backward: the same
    two all-to-alls with the dims swapped, in reverse order.

    Args:
        x: this rank's tile (real or complex).
        split_dim: the dim the tiles split.
        other_dim: the second transformed dim (whole on every rank).
        group: the process group (``None``: the default group, resolved at call time).
        norm: as in ``torch.fft.fft2``.
        inverse: compute ``torch.fft.ifft2`` instead.

    Returns:
        This rank's tile of the (complex) transform.

    Raises:
        ValueError: ``split_dim`` and ``other_dim`` are the same dim.
        IndexError: either dim is out of range.
        CollectiveArgumentError: the ranks disagree on ``norm``, ``inverse``, the dims or
            the length of ``other_dim`` (on every rank); or another rank's arguments
            raised there (this rank names it; that rank raises its own error).
        RuntimeError: every rank's tile is empty (as ``torch.fft.fft2`` of no points).

    Shape:
        ``x``: ``(*, N_r, *, M, *)`` (``N_r`` this rank's rows); output: the same shape.

    Example:
        >>> import torch
        >>> from tensorpar.nn import distributed_fft2
        >>> x = torch.randn(4, 6)
        >>> y = distributed_fft2(x, split_dim=0, other_dim=1)  # one rank: fft2 itself
        >>> torch.allclose(y, torch.fft.fft2(x))
        True
    """
    if compiling():  # (each rank's rows exchanged on the host: run between graphs)
        out: torch.Tensor = between_graphs(distributed_fft2, x, split_dim=split_dim,
                                           other_dim=other_dim, group=group, norm=norm,
                                           inverse=inverse)
        return out
    g = resolve_group(group, "distributed_fft2")
    try:
        s, o = _dims("distributed_fft2", x, split_dim, other_dim)
        y = _fft(x, o, norm, inverse)  # (.., N_r, .., M)
    except Exception as exc:  # (on every rank: its peers would wait in the exchange)
        if not g.is_single:
            _rows("distributed_fft2", x, 0, 0, g, None, norm, problem=exc)
        raise
    if g.is_single:
        _refuse_no_points("distributed_fft2", x.shape[s])
        return _fft(y, s, norm, inverse)
    rows = _rows("distributed_fft2", x, s, o, g, None, norm, inverse)
    width = y.shape[o]
    y = _to_columns(y, s, o, g)  # (.., N, .., M'/W)
    y = _fft(y, s, norm, inverse)
    return _to_rows(y, s, o, g, rows, width)  # (.., N_r, .., M)


def _rfft(t: torch.Tensor, dim: int, norm: Norm, keep: int) -> torch.Tensor:
    """The first ``keep`` columns of ``torch.fft.rfft`` along ``dim``."""
    if t.numel() == 0:  # an empty tile: same shape as rfft's, still in the graph
        _probe(torch.fft.rfft, t, norm)
        return t.to(torch.promote_types(t.dtype, torch.complex64)).narrow(dim, 0, keep)
    out: torch.Tensor = torch.fft.rfft(t, dim=dim, norm=norm)
    return out.narrow(dim, 0, keep)


def _irfft(t: torch.Tensor, dim: int, n: int, norm: Norm) -> torch.Tensor:
    """``torch.fft.irfft`` to ``n`` points (columns past ``t``'s are zeros)."""
    if t.numel() == 0:
        _probe(torch.fft.irfft, t, norm)
        real = t.real
        pad = list(real.shape)
        pad[dim] = n - real.shape[dim]
        return torch.cat([real, real.new_zeros(pad)], dim=dim)
    out: torch.Tensor = torch.fft.irfft(t, n=n, dim=dim, norm=norm)
    return out


def distributed_rfft2_apply(x: torch.Tensor, fn: SpectrumFn, *, split_dim: int, other_dim: int,
                            columns: int | None = None, sizes: Sequence[int] | None = None,
                            group: GroupLike = None, norm: Norm = None) -> torch.Tensor:
    """``irfft2(fn(rfft2(x)[:columns]))`` of a real tensor split along ``split_dim``.

    ``rfft2`` runs over ``(split_dim, other_dim)`` (the halved, real-to-complex transform
    along ``other_dim``), only its first ``columns`` columns are kept, ``fn`` maps them, and
    ``irfft2`` returns to ``other_dim``'s length (the columns past ``columns`` are zeros).
    Each rank holds a contiguous tile of rows along ``split_dim``, in rank order, of any
    length (0 included); the result is split the same way.

    ``fn`` sees the spectrum *transposed*: all ``N`` frequencies of ``split_dim`` (torch's
    order) and a block of the kept columns, and it is called as ``fn(spectrum, start)``
    with ``start`` the block's first kept column. Rank ``r``'s block is columns
    ``[r c, (r + 1) c)`` with ``c = ceil(columns / W)``; columns at or past ``columns`` are
    zero padding and their result is dropped. ``fn`` must keep the ``split_dim`` and
    ``other_dim`` lengths (other dims, channels, may change) and keep its output in the
    autograd graph of its input (every rank's backward runs the transposes). A weight that
    ``fn`` uses gets this rank's block's share of its gradient: sum it over the group
    (a data-parallel reducer over these ranks does) for the dense gradient.

    Forward: all-to-all to the transposed layout (only the kept columns travel), then back.
    Backward: the same two all-to-alls with the dims swapped, in reverse order.

    Args:
        x: this rank's tile (real).
        fn: the map of the spectrum, applied in the transposed layout.
        split_dim: the dim the tiles split.
        other_dim: the real-to-complex dim (whole on every rank).
        columns: kept columns of the ``other_dim`` spectrum (default: all, ``M // 2 + 1``).
        sizes: every rank's rows along ``split_dim`` if known (saves one small all-gather,
            and with it the check that the ranks agree on the other arguments and that
            none raised alone; only this rank's entry is checked, unless in validation
            mode). Give it on every rank or on none: a rank without it waits in the
            exchange the others skip.
        group: the process group (``None``: the default group, resolved at call time).
        norm: as in ``torch.fft.rfft2`` (and the inverse).

    Returns:
        This rank's tile of the (real) result.

    Raises:
        ValueError: ``split_dim`` equals ``other_dim``, ``columns`` is out of range, or
            ``sizes`` disagrees with this rank's tile.
        IndexError: either dim is out of range.
        CollectiveArgumentError: the ranks disagree on ``norm``, ``columns``, the dims or
            the length of ``other_dim``, or another rank's arguments raised there (on every
            rank; not checked when ``sizes`` is given).
        RuntimeError: every rank's tile is empty (as ``torch.fft.rfft2`` of no points).

    Shape:
        ``x``: ``(*, N_r, *, M, *)``; ``fn`` gets ``(*, N, *, c, *)``; output:
        ``(*, N_r, *, M, *)`` (other dims as ``fn`` leaves them).

    Example:
        >>> import torch
        >>> from tensorpar.nn import distributed_rfft2_apply
        >>> x = torch.randn(4, 6)
        >>> y = distributed_rfft2_apply(x, lambda s, start: 2 * s, split_dim=0, other_dim=1)
        >>> torch.allclose(y, 2 * x, atol=1e-6)  # one rank: irfft2(2 rfft2(x))
        True
    """
    if compiling():  # (as distributed_fft2)
        out: torch.Tensor = between_graphs(distributed_rfft2_apply, x, fn,
                                           split_dim=split_dim, other_dim=other_dim,
                                           columns=columns, sizes=sizes, group=group,
                                           norm=norm)
        return out
    name = "distributed_rfft2_apply"
    g = resolve_group(group, name)
    try:
        s, o = _dims(name, x, split_dim, other_dim)
        width, half = x.shape[o], x.shape[o] // 2 + 1
        keep = half if columns is None else columns
        if not 1 <= keep <= half:
            raise ValueError(f"{name}: columns={columns}, expected 1 to {half} (the rfft of "
                             f"{width} points along dim {other_dim})")
        y = _rfft(x, o, norm, keep)  # (.., N_r, .., K)
    except Exception as exc:  # (on every rank, as distributed_fft2)
        if not g.is_single:
            _rows(name, x, 0, 0, g, sizes, norm, problem=exc)
        raise
    if g.is_single:
        _refuse_no_points(name, x.shape[s])
        y = fn(_fft(y, s, norm, False), 0)
        return _irfft(_fft(y, s, norm, True), o, width, norm)
    rows = _rows(name, x, s, o, g, sizes, norm, keep=keep)
    y = _to_columns(y, s, o, g)  # (.., N, .., K'/W)
    y = fn(_fft(y, s, norm, False), g.rank * y.shape[o])
    y = _to_rows(_fft(y, s, norm, True), s, o, g, rows, keep)  # (.., N_r, .., K)
    return _irfft(y, o, width, norm)
