"""Parameters without a gradient at the end of a backward pass, for the data-parallel reducer.

A parameter the backward pass did not reach still takes part in its bucket's all-reduce (the
buckets are fixed): it contributes what its ``.grad`` holds from earlier steps, or zeros, as
in PyTorch DDP. Which ranks used which parameter is exchanged only where it is needed
(``find_unused_parameters=True``, or validation mode for an error on every rank); otherwise
a rank knows only its own unused parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar import _comm
from tensorpar._group import Group
from tensorpar.errors import ReducerError

__all__ = ["exchange_usage", "local_unused_error", "unused_error"]


def exchange_usage(used: Sequence[bool], group: Group, device: torch.device) -> torch.Tensor:
    """Every rank's usage flags: a ``(group size, len(used))`` bool tensor on the CPU."""
    mine = torch.tensor(list(used), dtype=torch.uint8, device=group.comm_device(device))
    every = torch.empty(group.size * mine.numel(), dtype=torch.uint8, device=mine.device)
    _comm.all_gather_into(every, mine, group, purpose="meta")
    return every.view(group.size, -1).cpu().bool()


def unused_error(names: Sequence[str], usage: torch.Tensor) -> ReducerError | None:
    """The error for parameters some rank did not use (``usage`` from `exchange_usage`)."""
    lines = [f"{names[i]!r} (no gradient on ranks "
             f"{[r for r in range(usage.shape[0]) if not usage[r, i]]})"
             for i in range(len(names)) if not bool(usage[:, i].all())]
    if not lines:
        return None
    return ReducerError(
        "BucketedAllReduce: parameters got no gradient in this backward pass: "
        + ", ".join(lines) + ". Pass find_unused_parameters=True if parts of the "
        "model are legitimately skipped, or detach the unused parameters.")


def local_unused_error(names: Sequence[str], rank: int) -> ReducerError:
    """The error for parameters this rank did not use, when no usage was exchanged."""
    return ReducerError(
        f"BucketedAllReduce: parameters got no gradient in this backward pass on rank {rank}: "
        f"{list(names)}. Pass find_unused_parameters=True if parts of the model are "
        f"legitimately skipped, or detach the unused parameters. (Without "
        f"find_unused_parameters no usage is exchanged, so only the ranks that skipped a "
        f"parameter know; in validation mode every rank raises this together.)")
