"""The data-parallel reducer's checks: unused parameters, a changed model, misplaced grads.

A parameter the backward pass did not reach still takes part in its bucket's all-reduce (the
buckets are fixed): it contributes what its ``.grad`` holds from earlier steps, or zeros, as
in PyTorch DDP. Which ranks used which parameter is exchanged only where it is needed
(``find_unused_parameters=True``, or validation mode for an error on every rank); otherwise
a rank knows only its own unused parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.errors import ReducerError

__all__ = ["describe_change", "exchange_usage", "grads_in_place_error", "local_unused_error",
           "unused_error"]


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


def describe_change(module: nn.Module, names: Sequence[str], params: Sequence[torch.Tensor]
                    ) -> str:
    """What changed in ``module``'s trainable parameters since the reducer took them."""
    known = {id(p) for p in params}
    for name, p in module.named_parameters():
        if id(p) not in known and p.requires_grad:
            return (f"BucketedAllReduce: parameter {name!r} was added (or made trainable) "
                    f"after the reducer was built; its gradient would never be averaged. "
                    f"Build the reducer after the model is final.")
    for name, param in zip(names, params, strict=True):
        if not param.requires_grad:
            return (f"BucketedAllReduce: parameter {name!r} had requires_grad=True when the "
                    f"reducer was built and is now False. Build the reducer after freezing "
                    f"parameters.")
    return ("BucketedAllReduce: the module's parameters changed after the reducer was "
            "built (a parameter was removed or replaced)")


def grads_in_place_error(names: Sequence[str], params: Sequence[torch.Tensor],
                         views: Sequence[torch.Tensor] | None, late: Sequence[str]
                         ) -> ReducerError | None:
    """The error if a .grad left its bucket view, or a parameter got two gradients in a pass.

    ``views``: the bucket views each .grad must be (None: gradients are not bucket views).
    """
    moved = [] if views is None else [names[i] for i, p in enumerate(params)
                                       if p.grad is not None and p.grad is not views[i]]
    if moved:
        return ReducerError(
            f"BucketedAllReduce: the .grad of {moved} was replaced during backward, after "
            f"its bucket took it; the averaged gradient is in the bucket, not in .grad")
    if late:
        return ReducerError(
            f"BucketedAllReduce: {sorted(set(late))} received a gradient twice in one "
            f"backward pass, so their averaged gradient is wrong; a parameter's "
            f"AccumulateGrad must run once per backward")
    return None
