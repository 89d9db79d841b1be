"""Expert parallelism below the layer: the count exchange, the row all-to-all, the matmul.

A token-expert pair travels as one row. Rows leave sorted by expert, so the rows for one
rank's block of experts are consecutive and one uneven all-to-all moves them all; its split
sizes come from one small exchange of every rank's per-expert counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar import _comm
from tensorpar._group import Group
from tensorpar._split import NATIVE_DTYPES
from tensorpar._switch import VALIDATE
from tensorpar.validation import check

__all__ = ["exchange_counts", "exchange_rows", "grouped_linear"]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def exchange_counts(counts: torch.Tensor, g: Group) -> list[list[int]]:
    """Every rank's ``counts`` (one small all-gather of int64s), as lists, rank by rank.

    This is the only host synchronisation of an expert-parallel layer: the split sizes of
    both all-to-alls (forward and backward) come from this one table.
    """
    device = g.comm_device()
    out = torch.empty(g.size * counts.numel(), dtype=torch.int64, device=device)
    _comm.all_gather_into(out, counts.to(device=device, dtype=torch.int64), g, purpose="meta")
    rows: list[list[int]] = out.view(g.size, -1).tolist()
    return rows


def _move(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], g: Group) -> torch.Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` to rank ``r``; ``recv[s]`` rows from ``s``."""
    send_buf = x.contiguous()
    out = send_buf.new_empty((sum(recv), *send_buf.shape[1:]))
    per_row = math.prod(send_buf.shape[1:])
    flat_in, flat_out, unit = send_buf.view(-1), out.view(-1), 1
    if send_buf.dtype not in NATIVE_DTYPES:  # move raw bytes
        flat_in, flat_out = flat_in.view(torch.uint8), flat_out.view(torch.uint8)
        unit = send_buf.element_size()
    _comm.all_to_all(flat_out, flat_in, [n * per_row * unit for n in recv],
                     [n * per_row * unit for n in send], g, native=True)
    return out


class _ExchangeRows(torch.autograd.Function):
    """Forward: uneven all-to-all of rows. Backward: the same with the sizes swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...],
                g: Group) -> torch.Tensor:
        ctx.sizes, ctx.group = (send, recv), g
        return _move(x, send, recv, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send, recv = ctx.sizes
        g = ctx.group
        if VALIDATE[0]:
            check("all_to_all", g, backward=True, dtype=grad.dtype, dim=0, dim2=0)
        back = _ExchangeRows.apply(grad, recv, send, g)  # type: ignore[no-untyped-call]
        return back, None, None, None


def exchange_rows(x: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], g: Group
                  ) -> torch.Tensor:
    """Send ``send[r]`` consecutive rows of ``x`` to rank ``r``; receive ``recv[s]`` from ``s``.

    Forward: one uneven all-to-all. Backward: its dual (the gradient's rows travel back).
    """
    if VALIDATE[0]:
        check("all_to_all", g, dtype=x.dtype, dim=0, dim2=0)
    if torch.is_grad_enabled() and x.requires_grad:
        out: torch.Tensor = _ExchangeRows.apply(x, send, recv, g)  # type: ignore[no-untyped-call]
        return out
    return _move(x.detach(), send, recv, g)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm needs strides)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands (else a loop over the experts)."""
    if _GROUPED_MM is None or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    elif x.device.type != "cuda" or x.dtype != torch.bfloat16 \
            or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    size = x.element_size()
    dims_ok = all(n * size % 16 == 0 for n in (*w.shape[1:], x.shape[-1]))
    return dims_ok and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
                   bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows each) times their expert's weight.

    Args:
        x: ``(R, in)`` rows, expert 0's first.
        weight: ``(E, out, in)``, or ``(E, in, out)`` when ``transposed``.
        counts: rows per expert (``E`` of them, summing to ``R``).
        bias: ``(E, out)`` or ``None``.
        transposed: the weight's layout (transformers' ``is_transposed``).

    Returns:
        ``(R, out)``. Every expert's weight takes part in the graph, even with no row, so
        its gradient is zeros rather than ``None`` (as in the dense module, whose stacked
        weight always has a gradient).
    """
    if x.shape[0] and _grouped_fits(x, weight):
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        w = weight if transposed else weight.transpose(-2, -1)  # (E, in, out)
        assert _GROUPED_MM is not None
        y: torch.Tensor = _ContiguousGrad.apply(  # type: ignore[no-untyped-call]
            _GROUPED_MM(x, w, offs=offs.to(x.device)))
        if x.shape[0] != sum(counts):
            raise ValueError(f"grouped_linear: counts sum to {sum(counts)}, x has {x.shape[0]}")
    else:
        parts = x.split(list(counts))
        y = torch.cat([p @ weight[e] if transposed else F.linear(p, weight[e])
                       for e, p in enumerate(parts)]) if parts else x.new_empty(
            (0, weight.shape[-1] if transposed else weight.shape[-2]))
    if bias is not None:
        y = y + bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0,
                                       output_size=x.shape[0])
    return y
