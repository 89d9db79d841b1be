"""Topology: which ranks share a machine, and the subgroups a 2-D collective runs on.

A job of ``machines x ranks_per_machine`` ranks has two kinds of subgroups:

- the **intra-machine** group of each machine (fast links: NVLink, shared memory, loopback);
- the **rails**: rank ``j`` of every machine (``j`` counted within its machine), the only
  ranks that talk across the network in a hierarchical all-reduce.

`Topology.detect` learns the layout from the launcher (``torchrun`` sets ``GROUP_RANK``,
the index of the machine, for every process); `Topology.grid` declares it. Both create the
subgroups once; every rank of the default group creates every subgroup, in the same order.

Example:
    >>> from tensorpar.hierarchical.topology import Topology
    >>> topo = Topology.grid(1)  # outside torch.distributed: one rank on one machine
    >>> topo
    Topology(machines=1, ranks_per_machine=1, machine=0, local_rank=0)
    >>> str(topo), topo.is_hierarchical
    ('1 machine x 1 rank', False)
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from tensorpar.comm import _comm
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.comm._group_pool import new_group

__all__ = ["Topology"]

_ROW = 5
"""Ints each rank contributes: parent-group id, group rank, group size, machine key, declared
ranks per machine (0: detect)."""


@dataclass(frozen=True, eq=False)
class Topology:
    """Which ranks of a group share a machine, with the subgroups that follow from it.

    Build one with `Topology.detect` or `Topology.grid` (both collective), not with the
    constructor. Ranks are numbered within the group the topology was built on; each machine
    holds ``ranks_per_machine`` of them, and ``local_rank`` is this rank's index within its
    machine (its rank in `intra_group`, in increasing rank order).

    Attributes:
        machines: number of machines.
        ranks_per_machine: ranks on each machine (the same on all).
        machine: the machine of this rank, ``0 <= machine < machines`` (machines are ordered
            by their lowest rank).
        local_rank: this rank's index within its machine (and its rail).
        machine_ranks: the group ranks of every machine, ``machine_ranks[m][j]``.
        global_ranks: the group the topology describes, as the global rank of each of its
            ranks (``global_ranks[r]`` is group rank ``r``); a topology serves only a group
            of these ranks in this order (`matches`).
        intra_group: the ranks of this machine, or ``None`` with one rank per machine.
        rails_group: rank ``local_rank`` of every machine, or ``None`` on one machine.
        gather_group: a second group of this machine's ranks (``None`` unless
            `is_hierarchical`): the hierarchical all-reduce gathers on it while it scatters on
            `intra_group`, so each group sees its collectives in one fixed order.

    The subgroups belong to the topology's collectives, which issue on them from a thread of
    their own: issue nothing else on them while a hierarchical all-reduce is in flight.
    """

    machines: int
    ranks_per_machine: int
    machine: int
    local_rank: int
    machine_ranks: tuple[tuple[int, ...], ...] = field(repr=False)
    global_ranks: tuple[int, ...] = field(repr=False)
    intra_group: dist.ProcessGroup | None = field(default=None, repr=False)
    rails_group: dist.ProcessGroup | None = field(default=None, repr=False)
    gather_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Number of ranks: ``machines * ranks_per_machine``."""
        return self.machines * self.ranks_per_machine

    @property
    def is_hierarchical(self) -> bool:
        """True with several machines of several ranks each: a 2-D algorithm can help."""
        return self.machines > 1 and self.ranks_per_machine > 1

    def matches(self, group: GroupLike) -> bool:
        """Whether ``group`` is the group this topology describes.

        It is when it has the same global ranks in the same order (another process group
        over those ranks qualifies). Local (no communication): every rank of a group that
        passes its own topology of the same kind gets the same answer.
        """
        return resolve_group(group, "Topology.matches").global_ranks() == self.global_ranks

    def __str__(self) -> str:
        m, r = self.machines, self.ranks_per_machine
        return f"{m} machine{'s' * (m != 1)} x {r} rank{'s' * (r != 1)}"

    @classmethod
    def detect(cls, group: GroupLike = None) -> Topology:
        """Learn the topology from the launcher's environment, confirmed across ranks.

        A process's machine is ``GROUP_RANK`` (set by ``torchrun``: the index of the node)
        or, without it, a hash of the host name. Every rank sends these as int64 ids in one
        all-gather over the default group, so all ranks agree on the layout.

        Collective over the **default group**, like ``torch.distributed.new_group``: every
        rank calls it at the same point. With ``group`` not the default group, each rank
        passes its own group, and these groups must partition the default group (e.g. the
        data-parallel groups of a job); the subgroups of all of them are created everywhere.

        Args:
            group: the group to describe (``None``: the default group); ranks in the result
                are ranks within this group.

        Returns:
            This rank's view of the topology of ``group``.

        Raises:
            ValueError: machines hold different numbers of ranks of ``group``, or the groups
                passed by the ranks do not partition the default group. Raised on every
                rank together.
        """
        machine_key = os.environ.get("GROUP_RANK")
        key = _host_key() if machine_key is None else \
            int(machine_key) if _is_int(machine_key) else _MALFORMED
        return cls._build("Topology.detect", group, key, 0)

    @classmethod
    def grid(cls, ranks_per_machine: int, group: GroupLike = None) -> Topology:
        """Declare the topology: group ranks ``[m * R, (m + 1) * R)`` share machine ``m``.

        Collective over the default group, with the same rules as `detect`; it exchanges
        one small int64 row per rank to check that every rank declared the same layout.

        Args:
            ranks_per_machine: ``R``, the ranks on every machine; it must divide the group
                size.
            group: the group to describe (``None``: the default group).

        Returns:
            This rank's view of the topology of ``group``.

        Raises:
            TypeError: ``ranks_per_machine`` is not an int.
            ValueError: ``ranks_per_machine`` is < 1 or does not divide the group size, the
                ranks declared different values, or the groups do not partition the
                default group. Raised on every rank together.
        """
        if isinstance(ranks_per_machine, bool) or not isinstance(ranks_per_machine, int):
            raise TypeError(f"Topology.grid: ranks_per_machine must be an int, "
                            f"got {type(ranks_per_machine).__name__}")
        if ranks_per_machine < 1:
            raise ValueError(f"Topology.grid: ranks_per_machine must be >= 1, "
                             f"got {ranks_per_machine}")
        return cls._build("Topology.grid", group, -1, ranks_per_machine)

    @classmethod
    def _build(cls, fn: str, group: GroupLike, key: int, declared: int) -> Topology:
        g = resolve_group(group, fn)
        world = resolve_group(None, fn)
        if world.is_single:  # one process: nothing to exchange or create
            table = [[0, 0, 1, key, declared]]
        else:
            table = _exchange(world, g, key, declared)
        declared = _agreed(fn, table)
        layouts = [_layout(fn, members, declared) for members in _partition(fn, table)]
        me = world.rank
        topo: Topology | None = None
        # detected: a machine is its key, whichever group its ranks are in (labels below -1,
        # apart from those of declared machines); declared: each group's, by its lowest rank
        _comm.note_machines({rank: -2 - row[3] for rank, row in enumerate(table)}
                            if declared == 0 else
                            {r: min(m) for layout in layouts for m in layout.machines for r in m})
        for layout in layouts:  # every rank creates every subgroup, in this order
            machines, per_machine = len(layout.machines), len(layout.machines[0])
            intra = [_new_group(ranks) for ranks in layout.machines] if per_machine > 1 else []
            gather = ([_new_group(ranks) for ranks in layout.machines]
                      if per_machine > 1 and machines > 1 else [])
            rails = ([_new_group([m[j] for m in layout.machines]) for j in range(per_machine)]
                     if machines > 1 else [])
            for m, machine in enumerate(layout.machines):
                if me in machine:
                    j = machine.index(me)
                    topo = cls(machines, per_machine, m, j, layout.group_ranks,
                               tuple(layout.global_ranks), intra[m] if intra else None,
                               rails[j] if rails else None, gather[m] if gather else None)
        if topo is None:  # unreachable: the exchange included this rank
            raise RuntimeError(f"{fn}: rank {me} is missing from its own topology")
        return topo


_MALFORMED = -2
"""The machine key a rank sends where its ``GROUP_RANK`` is no integer (every rank raises)."""


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _host_key() -> int:
    """A stable int63 id of this host, for processes not launched by torchrun."""
    digest = hashlib.sha1(socket.gethostname().encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _exchange(world: Group, g: Group, key: int, declared: int) -> list[list[int]]:
    """One row of `_ROW` int64s per rank, exchanged over the default group (no pickle)."""
    first = g.global_rank(0) if g.handle is not None else 0
    return _comm.exchange_ints(world, [first, g.rank, g.size, key, declared])


def _agreed(fn: str, table: Sequence[Sequence[int]]) -> int:
    """The ranks_per_machine every rank declared (0: detected), checked on every rank.

    Raises:
        ValueError: the ranks described the layout differently (`Topology.grid` with other
            values, or beside `Topology.detect`), or a ``GROUP_RANK`` is no integer.
    """
    described = sorted({row[4] for row in table})
    if len(described) > 1:
        shown = "; ".join(f"{'Topology.detect' if d == 0 else f'ranks_per_machine={d}'} on "
                          f"rank(s) {[r for r, row in enumerate(table) if row[4] == d]}"
                          for d in described)
        raise ValueError(f"{fn}: the ranks described the layout differently ({shown}); every "
                         f"rank must call Topology.grid with one value, or Topology.detect")
    bad = [r for r, row in enumerate(table) if row[3] == _MALFORMED]
    if bad:
        raise ValueError(f"{fn}: GROUP_RANK on rank(s) {bad} is not an integer (it is the "
                         f"launcher's index of the machine){_own_group_rank()}")
    return int(described[0])


def _partition(fn: str, table: Sequence[Sequence[int]]) -> list[list[tuple[int, int, int]]]:
    """The parent groups, as their members' ``(global rank, machine key, declared)``.

    Members are in group-rank order. Checks that the ranks' groups partition the default group.
    """
    parents: dict[int, dict[int, tuple[int, int, int]]] = {}
    sizes: dict[int, int] = {}
    for rank, (first, group_rank, size, key, declared) in enumerate(table):
        members = parents.setdefault(first, {})
        if group_rank in members or sizes.setdefault(first, size) != size:
            raise ValueError(
                f"{fn}: the groups passed by the ranks overlap or disagree (rank {rank} "
                f"says it is rank {group_rank} of a group of {size} starting at global rank "
                f"{first}); every rank of the default group must call {fn} with its own "
                f"group, and these groups must not overlap")
        members[group_rank] = (rank, key, declared)
    result = []
    for first in sorted(parents):
        members = parents[first]
        if len(members) != sizes[first]:
            raise ValueError(
                f"{fn}: the group starting at global rank {first} has {sizes[first]} ranks "
                f"but only {len(members)} called {fn} with it; every rank of the default "
                f"group must call {fn}, each with its own group")
        result.append([members[r] for r in range(sizes[first])])
    return result


@dataclass(frozen=True)
class _Layout:
    group_ranks: tuple[tuple[int, ...], ...]  # group ranks of each machine
    machines: list[list[int]]  # global ranks of each machine, in increasing order
    global_ranks: list[int]  # global rank of each group rank


def _layout(fn: str, members: list[tuple[int, int, int]], declared: int) -> _Layout:
    """Group one parent group's members by machine and check that machines are equal."""
    size = len(members)
    if declared:
        if size % declared:
            raise ValueError(
                f"{fn}: ranks_per_machine={declared} does not divide the group size {size} "
                f"({size} = {size // declared} * {declared} + {size % declared})")
        keys = [r // declared for r in range(size)]
    else:
        keys = [key for _, key, _ in members]
    by_machine: dict[int, list[int]] = {}
    for group_rank, key in enumerate(keys):
        by_machine.setdefault(key, []).append(group_rank)
    machines = sorted(by_machine.values(), key=lambda ranks: ranks[0])
    counts = [len(m) for m in machines]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{fn}: machines hold different numbers of ranks: {counts} (group size {size} = "
            f"{' + '.join(map(str, counts))}); a hierarchical layout needs the same number "
            f"on every machine. Use the flat algorithm, or Topology.grid to declare a layout")
    global_of = [rank for rank, _, _ in members]
    # a subgroup numbers its ranks in increasing global-rank order; order the machine that way
    machines = [sorted(m, key=lambda r: global_of[r]) for m in machines]
    return _Layout(tuple(tuple(m) for m in machines), [[global_of[r] for r in m] for m in machines],
                   global_of)


def _own_group_rank() -> str:
    """This rank's ``GROUP_RANK`` where it is malformed, for the error."""
    text = os.environ.get("GROUP_RANK")
    return "" if text is None or _is_int(text) else f"; this rank has GROUP_RANK={text!r}"


def _new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """``torch.distributed.new_group``, which every rank of the default group calls.

    ``None`` on ranks outside ``ranks``, and outside torch.distributed.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    pg = new_group(ranks)
    return pg if isinstance(pg, dist.ProcessGroup) else None
