"""Gradient sums a model makes over groups of its own, handed over to the reducer.

A domain-parallel model's parameters see only this rank's tile, so their dense gradient is
the sum over the domain group(s). With a data-parallel axis beside it, two reductions of the
same ``.grad`` (the domain's at the end of the backward, the reducer's bucket all-reduces
while the backward runs) would race. Instead the model hands its sums to the reducer: every
gradient is made one whose sum over the model's groups is the dense gradient, and the reducer
all-reduces each bucket once over the product of its replica group and those groups, dividing
by the number of replicas only. One all-reduce per bucket, in the reducer's fixed bucket
order, so ranks whose gradients arrive in another order (an empty tile) still agree.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import nn

from tensorpar.comm._comm import exchange_ints
from tensorpar.comm._group import Group, resolve_group
from tensorpar.comm._group_pool import names_agree, new_group

__all__ = ["PartialSums", "partial_sums_of", "product_group", "register_partial_sums"]

_ATTR = "_tensorpar_partial_sums"


class PartialSums(Protocol):
    """What a model that sums some gradients over groups of its own offers a reducer."""

    def sum_groups(self) -> tuple[Group, ...]:
        """The groups its parameters' gradients are summed over (the product is taken)."""
        ...

    def hand_over(self) -> None:
        """Stop summing; leave gradients whose sum over `sum_groups` is the dense gradient."""
        ...


def register_partial_sums(module: nn.Module, sums: PartialSums) -> None:
    """Record that ``module``'s gradients are summed by ``sums`` (one per module)."""
    module.__dict__[_ATTR] = sums


def partial_sums_of(module: nn.Module) -> PartialSums | None:
    """The `PartialSums` registered on ``module``, or ``None``."""
    sums: PartialSums | None = module.__dict__.get(_ATTR)
    return sums


def product_group(groups: tuple[Group, ...], fn: str) -> Group:
    """The group of every rank reachable from this one through ``groups`` (their product).

    Collective over each of ``groups`` in turn: every rank of them calls it at the same
    point. For a data-parallel group and a domain group of one 2-D mesh, the result is the
    whole mesh. Spanning every rank, it is the default group, unless one of ``groups`` is
    (the model's own collectives run there while the reducer all-reduces): then a new
    group over every rank. Otherwise it is created with ``use_local_synchronization``
    (only its members call ``new_group``).

    Raises:
        ValueError: the groups are not the dims of one mesh (the product's size is not the
            product of their sizes).
    """
    block = {groups[0].global_rank(groups[0].rank)}
    for g in groups:
        if g.is_single:
            continue
        mine = sorted(block)
        width = max(r[0] for r in exchange_ints(g, [len(mine)]))
        rows = exchange_ints(g, mine + [-1] * (width - len(mine)))
        block = {int(r) for row in rows for r in row if r >= 0}
    expected = 1
    for g in groups:
        expected *= g.size
    if len(block) != expected:
        raise ValueError(f"{fn}: the groups (sizes {[g.size for g in groups]}) do not form a "
                         f"mesh: they reach {len(block)} ranks, not {expected}; use the dims of "
                         f"one DeviceMesh")
    ranks = sorted(block)
    if not dist.is_initialized():
        return resolve_group(None, fn)
    if len(ranks) == dist.get_world_size():
        if not any(not g.is_single and g.handle is dist.group.WORLD for g in groups):
            return resolve_group(None, fn)
        # one of the groups is the default group (a single replica of a domain over every
        # rank): the model's own exchanges run on it while the backward runs, and the ranks
        # launch their bucket all-reduces between them in different orders; a group of the
        # reducer's own keeps the two apart (every rank calls this: all create it)
        return resolve_group(new_group(ranks), fn)
    # torch names a new group from the number of groups each member knows: they must agree
    # (within each group, so across the whole connected block)
    if not all(names_agree(g) for g in groups if not g.is_single):
        raise ValueError(f"{fn}: the ranks {ranks} have created different numbers of process "
                         f"groups, so a group over them cannot be created consistently; build "
                         f"the reducer over groups of one DeviceMesh spanning every rank")
    return resolve_group(new_group(ranks, local=True), fn)
