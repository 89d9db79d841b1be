"""Uneven inputs for tensorpar's DistributedDataParallel: the hook ``Join`` runs.

Under ``torch.distributed.algorithms.Join``, a rank that has run out of batches keeps
answering the collectives of the ranks still training, as DDP's own join hook does: each
training forward of theirs begins with ``Join``'s all-reduce of "still here" (the joined
rank's side is in ``Join`` itself), then the buffer broadcast from a common rank and a flag
saying whether the backward synchronises; the joined rank mirrors those, then the
backward's collectives with zero gradients. When every rank has joined, the last one to
join broadcasts its model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from tensorpar.collectives._buffers import broadcast_coalesced, common_rank, sum_flags
from tensorpar.ddp.reducer import BucketedAllReduce

__all__ = ["DDPJoinHook"]


class DistributedDataParallel(Protocol):
    """What the hook uses of tensorpar's ``DistributedDataParallel`` (which builds it)."""

    module: nn.Module
    reducer: BucketedAllReduce
    _divide_by_live_ranks: bool

    @property
    def join_device(self) -> torch.device: ...


class DDPJoinHook(JoinHook):
    """Shadows a `DistributedDataParallel` training step on a rank that ran out of inputs.

    Args:
        ddp: the wrapper.
        divide_by_initial_world_size: divide by the group size (True) or by the number of
            ranks still training (False).

    Raises:
        ValueError: ``divide_by_initial_world_size=False`` where the reducer does not
            divide by the group size alone (a comm hook, ``average=False`` or a
            ``gradient_predivide_factor``); the model sums gradients over groups of its
            own (a domain-parallel model).
    """

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool
                 ) -> None:
        reducer = ddp.reducer
        if reducer.replicas != reducer.group.size:
            raise ValueError(f"{type(ddp).__name__}.join: not supported for a model that sums "
                             f"gradients over groups of its own (a domain-parallel model): "
                             f"every rank of its domain must run each step")
        plain = (reducer._hook is None and reducer._post == 1.0
                 and reducer._pre == float(reducer.group.size))
        if not divide_by_initial_world_size and not plain:
            raise ValueError(
                f"{type(ddp).__name__}.join: divide_by_initial_world_size=False needs the "
                f"default averaging (no comm hook, average=True, no "
                f"gradient_predivide_factor); got divide by {reducer._pre} before and "
                f"{reducer._post} after the all-reduce"
                + (" and a comm hook" if reducer._hook is not None else ""))
        ddp._divide_by_live_ranks = not divide_by_initial_world_size
        self.ddp = ddp

    def main_hook(self) -> None:
        """Answer one training step of the ranks still training."""
        ddp = self.ddp
        reducer = ddp.reducer
        reducer._joining = True
        device = ddp.join_device
        if reducer._will_sync_buffers():
            reducer._sync_buffers(common_rank(reducer.group, False, device))
        synchronised = sum_flags(reducer.group, False, device) > 0
        reducer._forward_sync = synchronised
        if synchronised:
            reducer._shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join."""
        reducer = self.ddp.reducer
        src = common_rank(reducer.group, is_last_joiner, self.ddp.join_device)
        module = self.ddp.module
        state = [*module.parameters(), *(module.buffers() if reducer.broadcast_buffers else ())]
        broadcast_coalesced(state, src, reducer.group)
