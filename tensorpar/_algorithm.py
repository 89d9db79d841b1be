"""Which all-reduce algorithm runs: flat, or hierarchical across machines (2-D)."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

from tensorpar._autograd import Launch, needs_graph
from tensorpar._group import Group
from tensorpar.hierarchical import hierarchical_all_reduce
from tensorpar.topology import Topology

__all__ = ["AUTO_MIN_BYTES", "Algorithm", "hierarchical_data", "hierarchical_topology"]

Algorithm: TypeAlias = Literal["flat", "hierarchical", "auto"]
ALGORITHMS = ("flat", "hierarchical", "auto")
AUTO_MIN_BYTES = 2 << 20
"""``"auto"`` goes hierarchical from this size up, with several machines of several ranks
(measured on 2 x 2 simulated machines over 500 Mbit/s links: hierarchical / flat was 0.98 at
1 MiB, 0.80 at 2 MiB, 0.69 at 16 MiB)."""


def hierarchical_topology(fn: str, algorithm: object, topology: object, x: torch.Tensor,
                          op: str, g: Group) -> Topology | None:
    """The topology to all-reduce over hierarchically, or ``None`` for the flat all-reduce.

    Raises:
        ValueError: an unknown ``algorithm``, no ``topology`` for a non-flat one, a topology
            of another size than the group, or what the hierarchical path cannot do
            (max/min, a tensor autograd records) when asked for explicitly.
        TypeError: ``topology`` is not a `Topology`.
    """
    if algorithm == "flat":
        return None
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{fn}: algorithm={algorithm!r}; expected one of {ALGORITHMS}")
    if topology is None:
        raise ValueError(f"{fn}: algorithm={algorithm!r} needs topology= "
                         f"(tensorpar.Topology.detect() or tensorpar.Topology.grid(...))")
    if not isinstance(topology, Topology):
        raise TypeError(f"{fn}: topology must be a tensorpar.Topology, got "
                        f"{type(topology).__name__}")
    ranks = topology.machines * topology.ranks_per_machine
    if ranks != g.size:
        raise ValueError(f"{fn}: the topology describes {topology.machines} machines x "
                         f"{topology.ranks_per_machine} ranks = {ranks}, but the group has "
                         f"{g.size} ranks")
    if algorithm == "auto":
        wins = (topology.machines > 1 and topology.ranks_per_machine > 1 and op != "max"
                and op != "min" and not needs_graph(x)
                and x.numel() * x.element_size() >= AUTO_MIN_BYTES)
        return topology if wins else None
    if op in ("max", "min") or needs_graph(x):
        raise ValueError(f"{fn}: algorithm='hierarchical' sums or averages tensors outside "
                         f"autograd (gradient buckets); got op={op!r}"
                         + (" and a tensor autograd records (detach it)" if needs_graph(x)
                            else ""))
    return topology


def hierarchical_data(x: torch.Tensor, topology: Topology, op: str, inplace: bool,
                      launch: Launch) -> torch.Tensor:
    """The hierarchical all-reduce of ``x`` (in place, or into a contiguous copy)."""
    out = x if inplace else x.detach().clone(memory_format=torch.contiguous_format)
    work = hierarchical_all_reduce(out, topology, op="mean" if op == "mean" else "sum",
                                   async_op=launch.async_op)
    launch.add(work, out)
    if inplace:
        torch.autograd.graph.increment_version(x)
    return out
