"""Bucket planning for the gradient reducer: flat buffers whose views are the gradients."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tensorpar.collaborative import CollaborativeTensor

__all__ = ["Bucket", "plan_buckets"]

MiB = 1 << 20


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer, reduced with one all-reduce.

    Attributes:
        index: position in launch order.
        buffer: the flat buffer; each parameter's ``.grad`` is a view of it.
        param_indices: indices (into the reducer's parameter list) of its parameters.
        param_names: their names, in buffer order.
        offsets: element offset of each parameter in ``buffer``.
        comm_dtype: the dtype the buffer travels in (``buffer.dtype`` unless a reduce or
            compression dtype is set).
    """

    index: int
    buffer: torch.Tensor
    param_indices: list[int]
    param_names: list[str]
    offsets: list[int]
    comm_dtype: torch.dtype
    pending: int = 0
    launched: bool = False
    handle: CollaborativeTensor | None = None
    future: torch.futures.Future[torch.Tensor] | None = field(default=None, repr=False)
    comm: torch.Tensor | None = field(default=None, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The gradients' dtype (the buffer's)."""
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.buffer.numel() * self.buffer.element_size()

    def view_of(self, slot: int, shape: torch.Size) -> torch.Tensor:
        """The gradient view of the ``slot``-th parameter of this bucket."""
        start = self.offsets[slot]
        return self.buffer[start: start + shape.numel()].view(shape)


def plan_buckets(params: Sequence[torch.Tensor], names: Sequence[str], order: Sequence[int],
                 cap_bytes: int, first_cap_bytes: int,
                 comm_dtype_of: dict[torch.dtype, torch.dtype]) -> list[Bucket]:
    """Assign parameters to buckets, taking them in ``order``.

    Parameters of one (dtype, device) share buckets. A bucket closes once it holds at
    least its cap (the first bucket opened has the smaller ``first_cap_bytes``), so a bucket
    exceeds its cap by at most its last parameter. Buckets are returned in the order they
    were opened, which is the order they are launched in.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    closed: list[list[int]] = []
    sizes: dict[int, int] = {}  # id(list) -> bytes
    order_of: dict[int, int] = {}

    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        members = open_buckets.get(key)
        if members is None:
            members = open_buckets[key] = []
            order_of[id(members)] = len(order_of)
            sizes[id(members)] = 0
        members.append(i)
        sizes[id(members)] += p.numel() * p.element_size()
        cap = first_cap_bytes if order_of[id(members)] == 0 else cap_bytes
        if sizes[id(members)] >= cap:
            closed.append(open_buckets.pop(key))
    closed.extend(open_buckets.values())
    closed.sort(key=lambda members: order_of[id(members)])

    buckets = []
    for index, members in enumerate(closed):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        first = params[members[0]]
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        buckets.append(Bucket(index, buffer, members, [names[i] for i in members], offsets,
                              comm_dtype_of.get(first.dtype, first.dtype)))
    return buckets


def default_bucket_cap_mb(params: Iterable[torch.Tensor]) -> float:
    """The bucket cap when none is given: a quarter of all the gradients, in [1, 25] MiB.

    With DDP's fixed 25 MiB a model of under ~100 MiB of gradients gets one or two large
    buckets, and the link idles while the largest fills. A quarter keeps at least four
    buckets streaming behind the backward pass; large models keep DDP's 25 MiB.
    """
    total = sum(p.numel() * p.element_size() for p in params)
    return min(25.0, max(1.0, total / 4 / MiB))
