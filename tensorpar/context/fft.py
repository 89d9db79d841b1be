"""``distributed_fft2``: a 2-D FFT of a field split along one of its two dims.

The transform along the split dim needs every rank's rows, so the data is transposed with
an all-to-all (split the other dim, gather the split one), transformed, and transposed
back. `tensorpar.all_to_all` carries uneven tiles (it exchanges the shapes) and its
backward is the all-to-all with the dims swapped; ``torch.fft`` is differentiable; so the
whole is autograd-safe with the mirrored communication in the backward.
"""

from __future__ import annotations

from typing import Literal

import torch

from tensorpar.collectives.functional import all_gather, all_to_all
from tensorpar.comm._group import GroupLike, resolve_group

__all__ = ["distributed_fft2"]

Norm = Literal["backward", "ortho", "forward"] | None


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
    g = resolve_group(group, "distributed_fft2")
    s, o = split_dim % x.ndim, other_dim % x.ndim
    if s == o:
        raise ValueError(f"distributed_fft2: split_dim={split_dim} and other_dim={other_dim} "
                         f"are the same dim of a {x.ndim}-D tensor; expected two dims")
    transform = torch.fft.ifft if inverse else torch.fft.fft

    def fft(t: torch.Tensor, dim: int, norm: Norm) -> torch.Tensor:
        if t.numel() == 0:  # a rank with no rows (the FFT libraries refuse empty batches)
            return t.to(torch.promote_types(t.dtype, torch.complex64)) * 1
        out: torch.Tensor = transform(t, dim=dim, norm=norm)
        return out
    y = fft(x, dim=o, norm=norm)  # (.., N_r, .., M)
    if g.is_single:
        return fft(y, dim=s, norm=norm)
    # every rank's rows, to hand each its own tile back
    rows = all_gather(torch.tensor([x.shape[s]], device=g.comm_device(x.device)), group=g,
                      sizes=[1] * g.size).tolist()
    width = y.shape[o]
    padded = -(-width // g.size) * g.size  # equal column tiles: one shape on every rank
    if padded != width:
        pad = list(y.shape)
        pad[o] = padded - width
        y = torch.cat([y, y.new_zeros(pad)], dim=o)
    y = all_to_all(y, split_dim=o, concat_dim=s, group=g)  # (.., N, .., M'/W)
    y = fft(y, dim=s, norm=norm)
    y = all_to_all(y, split_dim=s, concat_dim=o, group=g, sizes=rows)  # (.., N_r, .., M')
    return y.narrow(o, 0, width)
