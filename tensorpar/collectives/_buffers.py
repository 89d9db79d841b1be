"""Coalesced broadcasts of module state, and the small agreements of uneven-input training.

A model's buffers (BatchNorm statistics, rotary tables, causal masks) and, at the end of an
uneven-input run, its parameters travel from one rank to the others in one broadcast per
device, whatever their number and dtypes: their bytes are packed into one flat ``uint8``
tensor (largest element size first, so that every tensor starts aligned), broadcast, and
copied back on the receiving ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar.collectives._autograd import torch_op
from tensorpar.comm import _comm
from tensorpar.comm._group import Group

__all__ = ["broadcast_coalesced", "common_rank", "sum_flags"]


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: Group) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s, one broadcast per device.

    Every rank passes its tensors of the same shapes and dtypes, in the same order.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for device, group_tensors in by_device.items():
            ordered = sorted(group_tensors, key=lambda t: -t.element_size())
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ordered])
            wire = flat.to(group.comm_device(device))
            _comm.broadcast(wire, src, group)
            if group.rank == src:
                continue
            wire = wire.to(device)
            start = 0
            for t in ordered:
                nbytes = t.numel() * t.element_size()
                t.copy_(wire[start: start + nbytes].view(t.dtype).view(t.shape))
                start += nbytes


def common_rank(group: Group, candidate: bool, device: torch.device) -> int:
    """The highest group rank among those passing ``candidate=True`` (-1 if none).

    One all-reduce (MAX) of one int64; every rank of ``group`` must call it.
    """
    mine = torch.tensor([group.rank if candidate else -1], dtype=torch.int64,
                        device=group.comm_device(device))
    _comm.all_reduce(mine, torch_op("max"), group)
    return int(mine.item())


def sum_flags(group: Group, flag: bool, device: torch.device) -> int:
    """How many ranks of ``group`` pass ``flag=True`` (one all-reduce; every rank calls it)."""
    total = torch.tensor([int(flag)], dtype=torch.int64, device=group.comm_device(device))
    _comm.all_reduce(total, torch_op("sum"), group)
    return int(total.item())
