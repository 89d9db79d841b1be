"""Process-group resolution: ``None`` -> WORLD at call time, group rank <-> global rank.

Every public entry point turns its ``group`` argument into a `Group` through
`resolve_group`. ``src``/``dst``/``owner`` arguments are always ranks *within* that
group; `global_rank` converts them for ``torch.distributed`` calls that want a
global rank.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, TypeAlias

import torch
import torch.distributed as dist

from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError, TensorparError

__all__ = ["Group", "GroupLike", "resolve_group"]

GroupLike: TypeAlias = "dist.ProcessGroup | Group | Any | None"
"""What may be passed as ``group``: ``None`` (the default group), a ``ProcessGroup``, a
one-dimensional ``DeviceMesh``, or (inside tensorpar) an already resolved `Group`."""


class Group(NamedTuple):
    """A resolved process group: a weak reference to its handle, our rank in it, its size.

    The reference is weak so that nothing tensorpar keeps (autograd graphs, placeholders,
    layers, reducers) extends a process group's life past ``destroy_process_group``: when
    the group goes away stays the caller's decision. Using it after that raises.

    ``ref`` is ``None`` when ``torch.distributed`` is not initialised and the caller asked
    for the default group: tensorpar then behaves as a single-rank group, so every
    collective works in a plain single-process script. (A named tuple: one is built on
    every collective call, and a tuple is the cheapest immutable record to build.)
    """

    ref: weakref.ReferenceType[dist.ProcessGroup] | None
    rank: int
    size: int

    @property
    def handle(self) -> dist.ProcessGroup | None:
        """The process group (``None``: torch.distributed is not initialised).

        Raises:
            TensorparError: the group has been destroyed since this was resolved.
        """
        if self.ref is None:
            return None
        handle = self.ref()
        if handle is None:
            raise TensorparError(
                f"the process group (size {self.size}) that this collective, tensor or layer "
                f"was set up with has been destroyed (destroy_process_group); build it again "
                f"on a live group")
        return handle

    @property
    def is_single(self) -> bool:
        """True for a group of one rank: collectives take the no-communication fast path."""
        return self.size == 1

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (a rank within this group)."""
        handle = self.handle
        if handle is None or handle is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(handle, group_rank)

    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each rank of the group, in group-rank order (no communication)."""
        handle = self.handle
        if handle is None or handle is dist.group.WORLD:
            return tuple(range(self.size))
        return tuple(dist.get_process_group_ranks(handle))

    def check_rank(self, fn: str, name: str, value: object) -> int:
        """Validate a ``src``/``dst``/``owner`` argument: an int in ``[0, size)``.

        Raises:
            CollectiveTypeError: not an int (also a ``TypeError``).
            CollectiveArgumentError: out of range (also a ``ValueError``).
        """
        if isinstance(value, bool) or not isinstance(value, int):
            raise CollectiveTypeError(
                f"{fn}: {name} must be an int (a rank within the group), "
                f"got {type(value).__name__}")
        if not 0 <= value < self.size:
            raise CollectiveArgumentError(
                f"{fn}: {name}={value} is not a rank of the group; "
                f"expected 0 <= {name} < {self.size} (group ranks, not global ranks)")
        return value

    def comm_device(self, hint: torch.device | None = None) -> torch.device:
        """The device to put communication buffers on for this group.

        ``hint`` (usually the data's device) wins when the group's backend supports it;
        otherwise the CPU if supported, else the backend's accelerator type (its current
        device).
        """
        if self.handle is None:
            return hint if hint is not None else torch.device("cpu")
        types = [t.type for t in _device_types(self.handle)]
        if hint is not None and (not types or hint.type in types):
            return hint
        if not types or "cpu" in types:
            return torch.device("cpu")
        return torch.device(types[0])


_DIST_AVAILABLE = dist.is_available()
_SINGLE = Group(None, 0, 1)
# The default group as last resolved (weakly held): a call with ``group=None`` reuses it while
# WORLD is still the same object, so the hot path builds nothing.
_default_group: list[Group] = [_SINGLE]


def _device_types(handle: dist.ProcessGroup) -> list[torch.device]:
    types = getattr(handle, "_device_types", None)
    return list(types) if types is not None else []


def _from_mesh(group: Any) -> dist.ProcessGroup:
    if group.ndim != 1:
        raise CollectiveArgumentError(
            f"a DeviceMesh passed as group must be 1-D, got a {group.ndim}-D mesh "
            f"with shape {tuple(group.shape)}; pass mesh[dim_name] instead")
    pg: dist.ProcessGroup = group.get_group()
    return pg


def resolve_group(group: GroupLike, fn: str = "tensorpar") -> Group:
    """Resolve ``group`` at call time (never at import time).

    Args:
        group: ``None`` for the default (WORLD) group, a ``ProcessGroup``, a 1-D
            ``DeviceMesh``, or a `Group` (returned unchanged: layers and the reducer resolve
            once and pass the result on).
        fn: the public function's name, used in error messages.

    Returns:
        The resolved `Group`.

    Raises:
        TypeError: ``group`` is none of the accepted kinds.
        ValueError: this process is not a member of ``group``.
    """
    if type(group) is Group:
        return group
    if group is None:
        # WORLD is None until init_process_group; this is cheaper than dist.is_initialized()
        handle = dist.group.WORLD if _DIST_AVAILABLE else None
        if handle is None:
            return _SINGLE
        cached = _default_group[0]
        if cached.ref is not None and cached.ref() is handle:  # the same default group
            return cached
    elif isinstance(group, dist.ProcessGroup):
        handle = group
    elif type(group).__name__ == "DeviceMesh":
        handle = _from_mesh(group)
    elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise CollectiveArgumentError(
            f"{fn}: this process (global rank {dist.get_rank()}) is not a member "
            f"of the group it was given")
    else:
        raise CollectiveTypeError(
            f"{fn}: group must be None, a ProcessGroup or a 1-D DeviceMesh, "
            f"got {type(group).__name__}")
    # the handle's own rank and size: its group rank, without torch's per-call lookups
    resolved = Group(weakref.ref(handle), handle.rank(), handle.size())
    if group is None:
        _default_group[0] = resolved
    return resolved
