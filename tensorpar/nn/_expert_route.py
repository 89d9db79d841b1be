"""Expert parallelism below the layer: the count exchange, the row all-to-all, the matmul.

A token-expert pair travels as one row. Rows leave sorted by expert, so the rows for one
rank's block of experts are consecutive and one uneven all-to-all moves them all; its split
sizes come from one small exchange of every rank's per-expert counts.

With replicated tokens nothing needs dispatching: each rank's experts take their rows from
the tokens it already holds, and one all-to-all that sends the rank's partial sums to
every peer (`gather_sum`) makes the output whole; `sum_grads_over_ranks` is its mirror
for the gradients of the tokens and of the routing weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.collectives._alltoall import AllToAllSpec, _AllToAll, all_to_all_data
from tensorpar.collectives._autograd import apply_or_run
from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.comm._launch import SYNC
from tensorpar.validation import check

__all__ = ["exchange_counts", "exchange_rows", "gather_sum", "grouped_linear",
           "sum_grads_over_ranks"]

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


def _rows_spec(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], g: Group
               ) -> AllToAllSpec:
    """The all-to-all of ``send[r]`` rows of ``x`` to rank ``r``, ``recv[s]`` from ``s``."""
    rest = x.shape[1:]
    return AllToAllSpec(g, 0, 0, tuple(send), tuple(torch.Size((n, *rest)) for n in recv),
                        even=False)


def exchange_rows(x: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], g: Group
                  ) -> torch.Tensor:
    """Send ``send[r]`` consecutive rows of ``x`` to rank ``r``; receive ``recv[s]`` from ``s``.

    Forward: one uneven all-to-all. Backward: its dual (the gradient's rows travel back).
    """
    check("all_to_all", g, dtype=x.dtype, dim=0, dim2=0)  # (validation mode)
    return apply_or_run(_AllToAll, x, _rows_spec(x, send, recv, g), SYNC)


def _rows_to_every_rank(x: torch.Tensor, sizes: Sequence[int], g: Group
                        ) -> list[torch.Tensor]:
    """Every rank's ``(sizes[r], C)`` rows on every rank, in rank order.

    One uneven all-to-all in which this rank sends its rows to each peer (none to itself).
    """
    me, n = g.rank, g.size
    mine = x.detach().contiguous()
    send = tuple(0 if r == me else sizes[me] for r in range(n))
    recv = tuple(0 if r == me else sizes[r] for r in range(n))
    copies = mine.unsqueeze(0).expand(n - 1, *mine.shape).reshape(-1, *mine.shape[1:])
    parts = list(all_to_all_data(copies, _rows_spec(copies, send, recv, g), SYNC)
                 .split(list(recv)))
    parts[me] = mine
    return parts


def _gather_sum(rows: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], total: int,
                g: Group) -> tuple[torch.Tensor, ...]:
    """Every tensor of ``rows`` gathered and summed at ``tokens``; several travel as one."""
    sizes = [len(t) for t in tokens]
    if len(rows) == 1:
        by_rank = [[part] for part in _rows_to_every_rank(rows[0], sizes, g)]
    else:  # side by side as raw bytes (the dtypes may differ: bfloat16 tokens, float32 weights)
        packed = torch.cat([r.detach().contiguous().view(torch.uint8) for r in rows], dim=-1)
        widths = [r.shape[-1] * r.element_size() for r in rows]
        # (a copy of its own: one row's slice counts as contiguous at an odd byte offset)
        by_rank = [[chunk.clone(memory_format=torch.contiguous_format).view(r.dtype)
                    for chunk, r in
                    zip(part.split(widths, dim=-1), rows, strict=True)]
                   for part in _rows_to_every_rank(packed, sizes, g)]
    outs = tuple(r.new_zeros((total, r.shape[-1])) for r in rows)
    for t, parts in zip(tokens, by_rank, strict=True):  # rank by rank: the same bits everywhere
        for out, part in zip(outs, parts, strict=True):
            out.index_add_(0, t, part)
    return outs


class _GatherSum(torch.autograd.Function):
    """Forward: every rank's partial rows, added at their tokens. Backward: this rank's rows.

    The consumer is replicated (every rank holds the whole gradient), so the backward
    needs no communication, as `tensorpar.gather_from_group`'s.
    """

    @staticmethod
    def forward(ctx: Any, tokens: tuple[torch.Tensor, ...], total: int, g: Group,
                *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mine = tokens[g.rank]
        return _gather_sum(rows, tokens, total, g)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, None, *(gr.index_select(0, ctx.mine) for gr in grads))


def gather_sum(rows: Sequence[torch.Tensor], tokens: tuple[torch.Tensor, ...], total: int,
               g: Group, *, backward: bool = False) -> tuple[torch.Tensor, ...]:
    """Every rank's ``rows`` added at its ``tokens``, on every rank (per tensor of ``rows``).

    Per tensor: the sum over ranks ``r`` of ``zeros(total, C).index_add(0, tokens[r], rank
    r's rows)``.

    Forward: one uneven all-to-all (this rank's ``len(tokens[rank])`` rows of every tensor,
    side by side, to every peer), then the rows added rank by rank, so every rank holds the
    same bits. Backward: this rank's rows of the (replicated) gradients, no communication.
    ``tokens[r]`` holds distinct indices; every rank passes the same ``tokens``.
    """
    check("all_to_all", g, backward=backward, dtype=rows[0].dtype,  # (validation mode)
          counters=(("tensors", len(rows), ""),), dim=0, dim2=0,
          label="the sum of every rank's expert outputs (ParallelExperts)")
    if torch.is_grad_enabled() and any(r.requires_grad for r in rows):
        out: tuple[torch.Tensor, ...] = _GatherSum.apply(  # type: ignore[no-untyped-call]
            tokens, total, g, *rows)
        return out
    return _gather_sum(rows, tokens, total, g)


class _SumGrads(torch.autograd.Function):
    """Forward: identity. Backward: each rank's partial gradients summed over the ranks.

    A rank's gradients of the replicated tokens and routing weights are non-zero only at
    the tokens its experts saw (``tokens[rank]``): those rows travel, the tokens' and the
    weights' side by side, in one `gather_sum`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, tokens: tuple[torch.Tensor, ...],
                g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.tokens, ctx.group, ctx.total = tokens, g, x.shape[0]
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def backward(ctx: Any, gx: torch.Tensor, gw: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        tokens, g = ctx.tokens, ctx.group
        mine = tokens[g.rank]
        wanted = [gr.index_select(0, mine) if want else None
                  for gr, want in zip((gx, gw), ctx.needs_input_grad[:2], strict=True)]
        sums = iter(gather_sum([gr for gr in wanted if gr is not None], tokens, ctx.total, g,
                               backward=True))
        out_x, out_w = (None if gr is None else next(sums) for gr in wanted)
        return out_x, out_w, None, None


def sum_grads_over_ranks(x: torch.Tensor, w: torch.Tensor, tokens: tuple[torch.Tensor, ...],
                         g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``w`` (replicated) whose gradients are summed over the ranks in backward.

    Forward: identity. Backward: one `gather_sum` of this rank's gradient rows at
    ``tokens[rank]`` (where a rank's partial gradients can be non-zero).

    Shape:
        ``x``: ``(T, H)``; ``w``: ``(T, K)``; ``tokens[r]``: distinct indices into ``T``.
    """
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        pair: tuple[torch.Tensor, torch.Tensor] = _SumGrads.apply(  # type: ignore[no-untyped-call]
            x, w, tokens, g)
        return pair
    return x, w


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
        out = weight.shape[-1] if transposed else weight.shape[-2]
        # no expert here (fewer experts than ranks): no row either, but the result stays
        # in x's graph, so the mirrored all-to-all after it runs in backward too
        y = torch.cat([p @ weight[e] if transposed else F.linear(p, weight[e])
                       for e, p in enumerate(parts)]) if parts else \
            x.narrow(-1, 0, min(1, x.shape[-1])).expand(x.shape[0], out) * 0
    if bias is not None:
        y = y + bias.repeat_interleave(torch.tensor(counts, dtype=torch.long,
                                                    device=bias.device), dim=0,
                                       output_size=x.shape[0])
    return y
