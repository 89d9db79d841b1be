"""The hierarchical (2-D) all-reduce: within machines, along the rails, within machines.

On ``M`` machines of ``R`` ranks, a flat ring all-reduce of ``n`` bytes sends
``2 (M R - 1) / (M R) * n`` bytes through every rank, and the ring crosses each machine's
network link with that much. The hierarchical algorithm sends only ``2 (M - 1) / M * n``
bytes over each machine's link:

1. **reduce-scatter within the machine**: rank ``j`` of the machine gets the machine's sum of
   shard ``j`` (``n / R`` elements);
2. **all-reduce along the rails**: rank ``j`` of every machine all-reduces shard ``j``, so
   ``R`` exchanges of ``n / R`` elements share the network, one per rail;
3. **all-gather within the machine**: every rank gets every reduced shard, in place.

Large tensors are cut into slices that flow through the three stages as a pipeline: slice
``k`` crosses the network while slice ``k + 1`` is reduced within the machine and slice
``k - 1`` is gathered. Successive calls on one `Topology` join the same pipeline, so
back-to-back buckets overlap the same way. Sizes that ``R`` does not divide keep their last
``numel % R`` elements out of the scatter: those few elements are all-reduced within the
machine and then along the rails, in place too.

All collectives on a topology's subgroups are issued by one thread per topology, in call
order, so the ranks always issue them in the same order whatever the caller's threads do.
The same code runs on gloo (CPU) and NCCL (CUDA).

That thread is stopped and joined, after the calls it has queued, when its topology is
collected, at interpreter exit (before the interpreter finalizes) or by
`shutdown_hierarchical`; a later call starts a new one. A thread left to run into the
interpreter's finalization would release its last work handles there, and a thread that
needs the GIL during finalization is killed, which aborts the process.
"""

from __future__ import annotations

from typing import Literal

import torch

from tensorpar.hierarchical._engine import engines
from tensorpar.hierarchical._work import HierarchicalWork
from tensorpar.hierarchical.topology import Topology

__all__ = ["DEFAULT_SLICE_BYTES", "HierarchicalWork", "hierarchical_all_reduce",
           "shutdown_hierarchical"]

DEFAULT_SLICE_BYTES = 4 * 2**20
"""Bytes per pipeline slice (on the simulated 2 x 2 cluster, 2 and 4 MiB slices were fastest
at 64 MiB; 8 and 16 MiB were 4-6% slower)."""


def hierarchical_all_reduce(tensor: torch.Tensor, topology: Topology, *,
                            op: Literal["sum", "mean"] = "sum", async_op: bool = False,
                            slice_bytes: int = DEFAULT_SLICE_BYTES) -> HierarchicalWork | None:
    """All-reduce ``tensor`` in place over the ranks of ``topology``, machine by machine.

    Forward: every rank's ``tensor`` becomes the sum (or mean) over the group, in place.
    Backward: none (an in-place primitive for gradient buckets, outside autograd;
    ``tensorpar.all_reduce(..., algorithm="hierarchical")`` is the differentiable form).

    Every rank of the topology's group must call it with a tensor of the same numel and dtype,
    in the same order with respect to other calls on the same topology. ``"mean"`` divides
    by the group size once, before reducing (no overflow in low precision, no double
    division). With one machine or one rank per machine this is a single all-reduce on the
    topology's own subgroup.

    Shape:
        Any shape; the tensor must be contiguous and is reduced as a flat view.

    Args:
        tensor: the tensor to reduce in place (CPU with gloo, CUDA with NCCL).
        topology: the layout of the group, from `Topology.detect` or `Topology.grid`.
        op: ``"sum"`` or ``"mean"``.
        async_op: return a `HierarchicalWork` at once instead of waiting.
        slice_bytes: pipeline slice size in bytes (rounded down to a whole number of
            elements, a multiple of the ranks per machine, at least one element each).

    Returns:
        ``None``, or with ``async_op=True`` a `HierarchicalWork`: ``tensor`` holds the result
        only after its ``wait()``.

    Raises:
        TypeError: ``tensor`` or ``topology`` has the wrong type, ``op="mean"`` on an
            integer tensor, or ``slice_bytes`` is not an int.
        ValueError: ``op`` is unknown, ``tensor`` is not contiguous, ``slice_bytes < 1``.
        TensorparError: a collective of the pipeline failed (raised by ``wait()``; a
            `CollectiveTimeoutError` or `PeerLostError` where that collective's was).

    Example:
        >>> import torch
        >>> from tensorpar.hierarchical.topology import Topology
        >>> x = torch.arange(4.0)
        >>> hierarchical_all_reduce(x, Topology.grid(1), op="mean")  # one rank: no-op
        >>> x
        tensor([0., 1., 2., 3.])
    """
    fn = "hierarchical_all_reduce"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"{fn}: topology must be a tensorpar.Topology (from "
                        f"Topology.detect or Topology.grid), got {type(topology).__name__}")
    if op not in ("sum", "mean"):
        raise ValueError(f"{fn}: op must be 'sum' or 'mean', got {op!r}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{fn}: op='mean' needs a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: tensor must be contiguous (it is reduced in place through a "
                         f"flat view), got shape {tuple(tensor.shape)} with strides "
                         f"{tensor.stride()}")
    if isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int):
        raise TypeError(f"{fn}: slice_bytes must be an int, got {type(slice_bytes).__name__}")
    if slice_bytes < 1:
        raise ValueError(f"{fn}: slice_bytes must be >= 1, got {slice_bytes}")
    work = HierarchicalWork()
    if tensor.numel() == 0 or topology.size == 1:
        work._issued.set()
        return work if async_op else None
    flat = tensor.detach().view(-1)  # the same memory, outside autograd (buckets are leaves)
    if op == "mean":
        flat.div_(topology.size)
    per_slice = slice_bytes // tensor.element_size()
    r = topology.ranks_per_machine
    engines(topology).submit(work, flat, max(r, per_slice - per_slice % r))
    if async_op:
        return work
    work.wait()
    return None


def shutdown_hierarchical(topology: Topology | None = None, *,
                          timeout: float | None = None) -> bool:
    """Stop the thread that issues ``topology``'s hierarchical collectives, and wait for it.

    The thread first finishes the calls already queued (their handles stay valid); a later
    call on the topology starts a new thread, after this one has ended, so calls keep their
    order. Topologies that are collected, and every topology at interpreter exit, get this
    automatically; call it to release the thread earlier (`BucketedAllReduce.remove` does,
    for its topology). Local: it issues no collective, but queued calls may wait for peers.

    Args:
        topology: the topology whose thread to stop (``None``: every topology's).
        timeout: seconds to wait for each thread (``None``: as long as it takes).

    Returns:
        ``True`` if every thread stopped within ``timeout``.

    Raises:
        TypeError: ``topology`` is not a `Topology` (or ``None``).

    Example:
        >>> from tensorpar.hierarchical.topology import Topology
        >>> shutdown_hierarchical(Topology.grid(1))  # no thread was started: nothing to stop
        True
    """
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"shutdown_hierarchical: topology must be a tensorpar.Topology "
                        f"or None, got {type(topology).__name__}")
    return engines.close(topology, timeout)
