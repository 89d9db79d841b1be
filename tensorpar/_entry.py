"""What every public collective does on entry, before it communicates.

Resolve the group; in validation mode, compare the call's fingerprint across the ranks
(before any check that could raise on one rank only); check the rank arguments and the form
of ``sizes``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorpar._group import Group, GroupLike, resolve_group
from tensorpar._split import check_sizes
from tensorpar._switch import VALIDATE
from tensorpar.validation import check_call

__all__ = ["resolve_args"]


def resolve_args(fn: str, group: GroupLike, sizes: Sequence[int] | None, *, x: object = None,
                 dim: object = None, op: object = None, backward: object = None,
                 label: str = "", **ranks: int) -> tuple[Group, tuple[int, ...] | None]:
    """Resolve ``group``, check the rank arguments (group ranks) and the form of ``sizes``.

    In validation mode the ranks first compare the call's fingerprint (``x``'s dtype and
    shape, ``dim``, ``op``, ``backward``, ``sizes``, the rank arguments and the call site;
    ``label`` names what the call is part of in messages).
    """
    g = resolve_group(group, fn)
    if VALIDATE[0] and g.size > 1:
        check_call(fn, g, x, dim, op, backward, sizes, next(iter(ranks.values()), -1), label)
    for name, value in ranks.items():
        g.check_rank(fn, name, value)
    return g, None if sizes is None else check_sizes(fn, sizes, g.size)
