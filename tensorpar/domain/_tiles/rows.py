"""Gather rows of a split tensor by global index: the data path under every halo exchange.

A tensor is split along one dim over a group: rank ``r`` holds global rows
``[off[r], off[r] + sizes[r])``. Each rank asks for a contiguous range of *global* rows
``[g0, g1)`` (it may reach outside the domain and past its neighbours). A row outside the
domain is mapped by the boundary ``mode`` (``"zeros"``: a fill value; ``"circular"``,
``"reflect"``, ``"replicate"``: the row it stands for). Every rank knows every rank's range
(computed with the same arithmetic everywhere), so it knows what to send without asking.

The answer is laid out as ``[lower halo | run of own rows | upper halo]`` along the dim: the
run is the part of ``[g0, g1)`` this rank holds itself (kept in place, one copy); the halo
rows come from a pool ``[rows received | own rows copied (reflect/circular) | fill row]``.
Rows received travel in one uneven all-to-all (point to point with the neighbours that have
something to send on gloo).

Backward is the mirror: the halo's gradient goes back to the rank that owns each row and is
*added* there (``index_add_``), so a row read by several ranks (or twice by one) receives
the sum of its gradients.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorpar.comm._comm import all_to_all as _all_to_all
from tensorpar.comm._group import Group
from tensorpar.validation import check

__all__ = ["RowPlan", "assemble", "gather_rows", "halo_pool", "map_row", "offsets", "plan_rows",
           "row_index", "start_exchange", "validate_exchange", "validate_rows"]

MODES = ("zeros", "circular", "reflect", "replicate")


def offsets(sizes: Sequence[int]) -> list[int]:
    """The start of each rank's rows: ``[0, s0, s0 + s1, ...]`` (one more entry than ranks)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def map_row(g: int, n: int, mode: str) -> int | None:
    """The domain row that global row ``g`` stands for (``None``: the fill value)."""
    if 0 <= g < n:
        return g
    if mode == "zeros" or n == 0:
        return None
    if mode == "circular":
        return g % n
    if mode == "replicate":
        return 0 if g < 0 else n - 1
    r = -g if g < 0 else 2 * (n - 1) - g  # reflect (the edge row is not repeated)
    if not 0 <= r < n:
        raise ValueError(f"reflect padding: row {g} reflects to {r}, outside a domain of "
                         f"{n} rows; expected a halo narrower than the domain")
    return r


@dataclass(frozen=True)
class RowPlan:
    """What one rank sends, receives and places for one row gather (see the module doc).

    Attributes:
        n_in: rows of this rank's tile.
        send_idx: local rows sent, grouped by receiving rank (in rank order).
        send_counts: rows sent to each rank (0 to itself).
        recv_counts: rows received from each rank (0 from itself).
        self_idx: own rows copied into the halo (a wrapped or reflected row).
        lower: pool index of each output row before the run.
        run: ``(a, b)``: local rows ``[a, b)`` kept in place.
        upper: pool index of each output row after the run.
        fill: whether the pool ends with a fill row.
        exchange: whether any rank of the group sends anything (the same on every rank).
        sizes: every rank's tile size (what validation mode compares).
    """

    n_in: int
    send_idx: tuple[int, ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    self_idx: tuple[int, ...]
    lower: tuple[int, ...]
    run: tuple[int, int]
    upper: tuple[int, ...]
    fill: bool
    exchange: bool
    sizes: tuple[int, ...] = ()

    @property
    def n_out(self) -> int:
        """The number of rows this rank holds after the exchange."""
        return len(self.lower) + self.run[1] - self.run[0] + len(self.upper)

    @property
    def is_identity(self) -> bool:
        """Nothing moves anywhere and this rank keeps its whole tile."""
        return not (self.exchange or self.lower or self.upper) and self.run == (0, self.n_in)


def _split_want(g0: int, g1: int, a: int, b: int) -> tuple[int, int]:
    """Where the run of own rows ``[a, b)`` sits inside ``[g0, g1)`` (global rows)."""
    start = min(max(g0, a), g1)
    end = max(start, min(g1, b))
    return start, end


def plan_rows(sizes: Sequence[int], wants: Sequence[tuple[int, int]], rank: int,
              mode: str = "zeros") -> RowPlan:
    """The plan of ``rank`` when each rank ``p`` asks for global rows ``wants[p]``.

    Pure arithmetic on the sizes: every rank computes every rank's requests the same way.
    """
    w = len(sizes)
    off = offsets(sizes)
    n = off[-1]
    ends = off[1:]
    send_lists: list[list[int]] = [[] for _ in range(w)]
    recv_counts = [0] * w
    mine_from: list[list[int]] = [[] for _ in range(w)]  # per source: my halo positions
    positions: list[tuple[str, int]] = []  # my halo rows in order: (kind, source/index)
    exchange = False
    my_run = (0, 0)
    for p in range(w):
        g0, g1 = wants[p]
        start, end = _split_want(g0, g1, off[p], off[p + 1])
        if p == rank and end > start:  # (an empty want keeps the empty run at 0)
            my_run = (start - off[p], end - off[p])
        for g in (*range(g0, start), *range(end, g1)):
            src = map_row(g, n, mode)
            if src is None:
                if p == rank:
                    positions.append(("fill", 0))
                continue
            q = bisect.bisect_right(ends, src)
            if q == p:
                if p == rank:
                    positions.append(("self", src - off[p]))
                continue
            exchange = True
            if q == rank:
                send_lists[p].append(src - off[q])
            if p == rank:
                positions.append(("recv", q))
                recv_counts[q] += 1
                mine_from[q].append(len(positions) - 1)
    # pool: [received rows by source rank | own rows | fill row]
    pool_of = [0] * len(positions)
    k = 0
    for q in range(w):
        for pos in mine_from[q]:
            pool_of[pos] = k
            k += 1
    self_idx = []
    for i, (kind, v) in enumerate(positions):
        if kind == "self":
            pool_of[i] = k
            self_idx.append(v)
            k += 1
    has_fill = any(kind == "fill" for kind, _ in positions)
    for i, (kind, _) in enumerate(positions):
        if kind == "fill":
            pool_of[i] = k
    g0, g1 = wants[rank]
    n_lower = min(max(g0, off[rank]), g1) - g0
    return RowPlan(
        n_in=sizes[rank],
        send_idx=tuple(i for lst in send_lists for i in lst),
        send_counts=tuple(len(lst) for lst in send_lists),
        recv_counts=tuple(recv_counts),
        self_idx=tuple(self_idx),
        lower=tuple(pool_of[:n_lower]),
        run=my_run,
        upper=tuple(pool_of[n_lower:]),
        fill=has_fill,
        exchange=exchange,
        sizes=tuple(sizes),
    )


def row_index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``values`` as an index tensor on ``like``'s device."""
    return torch.tensor(values, dtype=torch.long, device=like.device)


def start_exchange(rows: torch.Tensor, dim: int, send: Sequence[int], recv: Sequence[int],
                   group: Group) -> tuple[torch.Tensor, Any]:
    """Post the exchange of ``rows`` (grouped by destination along ``dim``).

    Returns what will arrive, by source, with the exchanged dim first, and the pending
    work (wait on it before reading).

    The backend's own all-to-all, also on gloo (``native``), where it runs on the
    backend's worker thread: point-to-point receives posted from this thread stalled it
    for up to 8 ms at a time while other messages were in flight (a 2-rank U-Net step
    lost 25-30 ms to them); gloo then sends zero bytes to the ranks with no rows.
    """
    flat = rows.movedim(dim, 0).contiguous()  # (rows, ...)
    per = _row_numel(flat)
    out = flat.new_empty((sum(recv), *flat.shape[1:]))
    work = _all_to_all(out.view(-1), flat.view(-1), [c * per for c in recv],
                       [c * per for c in send], group, async_op=True, native=True)
    return out, work


def _exchange(rows: torch.Tensor, dim: int, send: Sequence[int], recv: Sequence[int],
              group: Group) -> torch.Tensor:
    """Send ``rows`` (grouped by destination along ``dim``); return what arrives, by source."""
    out, work = start_exchange(rows, dim, send, recv, group)
    work.wait()
    return out.movedim(0, dim)


def _row_numel(flat: torch.Tensor) -> int:
    n = 1
    for s in flat.shape[1:]:
        n *= s
    return n


def _with_rows(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def halo_pool(x: torch.Tensor, dim: int, plan: RowPlan, arrived: torch.Tensor | None,
              fill: float) -> torch.Tensor | None:
    """The rows the halo is picked from: ``[rows arrived | own rows copied | fill row]``.

    ``arrived``: what the exchange brought, by source (``None``: nothing). ``None`` when
    the pool is empty (then this rank has no halo rows).
    """
    pieces = [] if arrived is None else [arrived]
    if plan.self_idx:
        pieces.append(x.index_select(dim, row_index(plan.self_idx, x)))
    if plan.fill:
        pieces.append(x.new_full(_with_rows(x, dim, 1), fill))
    return torch.cat(pieces, dim) if len(pieces) > 1 else (pieces[0] if pieces else None)


def _gather(x: torch.Tensor, dim: int, plan: RowPlan, group: Group, fill: float
            ) -> torch.Tensor:
    arrived = None
    if plan.exchange:
        sent = x.index_select(dim, row_index(plan.send_idx, x))
        arrived = _exchange(sent, dim, plan.send_counts, plan.recv_counts, group)
    return assemble(x, dim, plan, halo_pool(x, dim, plan, arrived, fill))


def assemble(x: torch.Tensor, dim: int, plan: RowPlan, pool: torch.Tensor | None
             ) -> torch.Tensor:
    """``[lower halo | run of own rows | upper halo]`` of ``x`` from the halo's ``pool``."""
    parts = []
    if plan.lower:
        assert pool is not None
        parts.append(pool.index_select(dim, row_index(plan.lower, x)))
    a, b = plan.run
    if b > a or not parts:
        parts.append(x.narrow(dim, a, b - a))
    if plan.upper:
        assert pool is not None
        parts.append(pool.index_select(dim, row_index(plan.upper, x)))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


def _add_back(g: torch.Tensor, dim: int, plan: RowPlan, group: Group) -> torch.Tensor:
    n_lower, (a, b), n_upper = len(plan.lower), plan.run, len(plan.upper)
    out = g.new_zeros(_with_rows(g, dim, plan.n_in))
    if b > a:
        out.narrow(dim, a, b - a).add_(g.narrow(dim, n_lower, b - a))
    n_recv, n_self = sum(plan.recv_counts), len(plan.self_idx)
    if n_lower or n_upper or plan.exchange:
        pool = g.new_zeros(_with_rows(g, dim, n_recv + n_self + int(plan.fill)))
        if n_lower:
            pool.index_add_(dim, row_index(plan.lower, g), g.narrow(dim, 0, n_lower))
        if n_upper:
            pool.index_add_(dim, row_index(plan.upper, g),
                            g.narrow(dim, n_lower + b - a, n_upper))
        if plan.exchange:
            back = _exchange(pool.narrow(dim, 0, n_recv), dim, plan.recv_counts,
                             plan.send_counts, group)
            out.index_add_(dim, row_index(plan.send_idx, g), back)
        if n_self:
            out.index_add_(dim, row_index(plan.self_idx, g), pool.narrow(dim, n_recv, n_self))
    return out


def validate_rows(t: torch.Tensor, dim: int, plan: RowPlan, group: Group, backward: bool
                  ) -> None:
    """Validation mode: compare this exchange's fingerprint across the ranks.

    Every rank's exchange must have the same dim, dtype, split and row shape, and this
    rank's tile the length the split gives it (else the same error on every rank).
    """
    validate_exchange(t.shape, t.dtype, dim, plan, group, backward)


def validate_exchange(shape: torch.Size, dtype: torch.dtype, dim: int, plan: RowPlan,
                      group: Group, backward: bool) -> None:
    """`validate_rows` of a tensor of this shape and dtype (one that need not exist).

    The dims before ``dim`` count as one: what the exchange sends is the same whether a
    path gave an unbatched tile a batch dim of 1 or not (ranks may take different paths).
    """
    if plan.exchange:
        rows = plan.n_out if backward else plan.n_in
        flat = torch.Size((math.prod(shape[:dim]), *shape[dim:]))
        check("halo exchange", group, backward=backward, dtype=dtype, shape=flat,
              shape_skips=[1], dim=dim - len(shape), sizes=plan.sizes,
              against_sizes=shape[dim] - rows, label="a domain-parallel layer")


class _RowGather(torch.autograd.Function):
    """Forward: gather rows by plan. Backward: `_RowAdd` (the rows' gradients added back)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, plan: RowPlan, group: Group,
                fill: float) -> torch.Tensor:
        ctx.args = (dim, plan, group)
        validate_rows(x, dim, plan, group, backward=False)
        return _gather(x, dim, plan, group, fill)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _RowAdd.apply(g, *ctx.args), None, None, None, None  # type: ignore[no-untyped-call]


class _RowAdd(torch.autograd.Function):
    """Forward: add gathered rows back to their owners. Backward: `_RowGather` (fill 0)."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, dim: int, plan: RowPlan, group: Group
                ) -> torch.Tensor:
        ctx.args = (dim, plan, group)
        validate_rows(g, dim, plan, group, backward=True)
        return _add_back(g, dim, plan, group)

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _RowGather.apply(gg, *ctx.args, 0.0), None, None, None  # type: ignore[no-untyped-call]


def gather_rows(x: torch.Tensor, dim: int, plan: RowPlan, group: Group, fill: float = 0.0
                ) -> torch.Tensor:
    """Apply ``plan`` to this rank's tile ``x`` along ``dim`` (autograd-aware).

    Every rank of ``group`` must call it with its own plan of the same request.
    """
    if plan.is_identity:
        return x
    out: torch.Tensor = _RowGather.apply(x, dim, plan, group, fill)  # type: ignore[no-untyped-call]
    return out
