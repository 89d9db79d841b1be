"""Data parallelism across pipeline replicas: average the stages' gradients after a step."""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.collectives.functional import all_reduce
from tensorpar.comm._group import GroupLike, resolve_group

__all__ = ["average_gradients"]


def average_gradients(model: nn.Module, *, group: GroupLike = None) -> None:
    """Average every gradient of ``model`` over the data-parallel ``group``, in place.

    Forward: all-reduce (mean) of the gradients, flattened per dtype and device into one
    buffer each. Backward: none (it runs after the backward pass).

    For pipeline replicas (`tensorpar.nn.pipeline` on each data-parallel rank, the same
    stage on every rank of ``group``): call it after ``step`` on every rank of ``group``.
    The microbatches' backwards accumulate into ``.grad`` inside ``step``, so one reduction
    per step, after it, replaces the per-backward hooks of a DDP wrapper. A parameter
    without a gradient takes part as zeros (and gets the average).

    Args:
        model: the pipeline (or any module whose replicas hold the same parameters).
        group: the data-parallel group (``None``: the default group, resolved at call time).
    """
    g = resolve_group(group, "average_gradients")
    if g.is_single:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        flat = all_reduce(flat, op="mean", group=g)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
