"""A small pool of process groups over the same ranks, so several collectives share the wire.

A gloo process group runs its asynchronous collectives on a fixed number of worker threads
(two by default): further ones queue behind them. Spreading buckets over ``k`` groups with the
same ranks keeps up to ``k`` times as many transfers in flight. Every member of the pool is a
real ``torch.distributed`` group, created once, in the same order on every rank.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from tensorpar._torch import C10D_WORLD, default_group_timeout
from tensorpar.comm import _comm
from tensorpar.comm._group import Group, resolve_group

__all__ = ["GroupPool", "names_agree", "new_group"]


class GroupPool:
    """``size`` process groups over the ranks of ``group``; member 0 is ``group`` itself.

    Building the pool is collective: every rank of ``group`` must build it at the same point,
    with the same ``size``. When ``group`` spans every rank, the new groups come from
    ``dist.new_group`` (which every rank of the default group then calls, as when every rank
    builds a reducer on the default group); on a subgroup, only its members create them
    (``use_local_synchronization``). The members' names are derived by torch from the ranks and
    the number of groups each process knows; where the members of ``group`` disagree on that
    number, the pool keeps ``group`` alone, on every rank alike.

    Args:
        group: the resolved group (member 0 of the pool).
        size: the number of groups wanted (1: just ``group``, nothing is created).
        fn: the caller's name, for error messages.

    Raises:
        ValueError: ``size`` is not a positive int.
    """

    def __init__(self, group: Group, size: int, fn: str) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{fn}: overlap_groups={size!r}, expected an int >= 1")
        self.groups: list[Group] = [group]
        self._created: list[dist.ProcessGroup] = []
        handle = group.handle
        if size == 1 or group.is_single or handle is None:
            return
        ranks = [group.global_rank(r) for r in range(group.size)]
        spans_world = group.size == dist.get_world_size()
        if not spans_world and not names_agree(group):
            return
        for _ in range(size - 1):
            pg = new_group(ranks, local=not spans_world)
            self._created.append(pg)
            self.groups.append(resolve_group(pg, fn))

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> Group:
        """The group for bucket ``index`` (``index % len(self)``)."""
        return self.groups[index % len(self.groups)]

    def __deepcopy__(self, memo: dict[int, object]) -> GroupPool:
        """The same pool: process groups cannot be copied (a copied model shares them)."""
        return self

    def close(self) -> None:
        """Destroy the groups this pool created (not the one it was given).

        Collective in spirit: every rank should close its pool at the same point.
        """
        for pg in self._created:
            with contextlib.suppress(Exception):  # already gone (destroy_process_group())
                dist.destroy_process_group(pg)
        self._created.clear()
        del self.groups[1:]


def names_agree(group: Group) -> bool:
    """Whether every member of ``group`` knows as many groups (so torch names new ones alike)."""
    names = getattr(C10D_WORLD, "pg_names", None)
    counts = [row[0] for row in
              _comm.exchange_ints(group, [len(names) if names is not None else -1])]
    return counts[0] >= 0 and all(c == counts[0] for c in counts)


def new_group(ranks: list[int], *, local: bool = False) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks)`` with the default group's timeout.

    torch gives a new group its own default (30 minutes for gloo) instead of the timeout
    the job chose, so a peer lost inside a subgroup's collective would be waited for that
    long. ``local``: only the members call it (``use_local_synchronization``).
    """
    pg: dist.ProcessGroup = dist.new_group(ranks=ranks, timeout=default_group_timeout(),
                                           use_local_synchronization=local)
    return pg
