"""Every rank's call of a builder compared before it changes anything.

A builder that cuts a model by its arguments (`tensorpar.nn.pipeline`,
`tensorpar.nn.parallelize_domain`) runs on each rank with that rank's arguments and model:
ranks given other ones would later wait for transfers that never come, or exchange data of
other sizes, or compute something else with no error at all. `agree_on_call` compares a
few facts of each rank's call in one all-gather of integers per group, and raises on every
rank naming what differs; a rank whose own call was refused says so, so that every rank
raises instead of going on to wait for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tensorpar.comm._comm import exchange_ints
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError

__all__ = ["agree_on_call", "agreed", "code_of", "structure"]

T = TypeVar("T")


OK, REFUSED, HEARD = 1, 0, -1
"""A row's first integer: this rank's call is accepted, refused, or accepted but a problem
was seen in an earlier group's exchange."""


def agreed(fn: str, groups: Sequence[Group], names: Sequence[str],
           device: torch.device | None, check: Callable[[], tuple[T, Sequence[object]]]) -> T:
    """Run this rank's ``check`` of its call, then compare the call with every rank's.

    ``check()`` raises where this rank's call is refused, else returns its result and the
    values of the facts ``names``. Either way the ranks meet in `agree_on_call`: a rank
    whose call was refused tells the others, then raises its own error.
    """
    try:
        result, values = check()
    except Exception:
        agree_on_call(fn, groups, names, None, device)
        raise
    agree_on_call(fn, groups, names, values, device)
    return result


def agree_on_call(fn: str, groups: Sequence[Group], names: Sequence[str],
                  values: Sequence[object] | None, device: torch.device | None) -> None:
    """Compare this rank's ``values`` of the facts ``names`` with every rank's; raise.

    ``groups``: one group, or the groups of a mesh's dims in order (each rank of the mesh
    in one group per dim). The groups exchange one after the other, each row carrying
    whether its rank saw a problem in the earlier groups, so that a refusal or a
    difference anywhere on the mesh reaches every rank. ``values``: this rank's (an int
    travels as it is, anything else as a hash of its text, and each rank shows its own in
    the error), or ``None`` where its own call was refused (the caller raises that error
    after this returns). ``device``: where the call's tensors are (the exchange's buffers
    go with them where the backend allows).

    Raises:
        CollectiveArgumentError: another rank's call was refused, or the calls differ.
    """
    row = [REFUSED] * (1 + len(names)) if values is None else [OK, *map(code_of, values)]
    problem = None
    for group in groups:  # every exchange before any raise: the next groups wait for it
        if group.size == 1:
            continue
        rows = exchange_ints(group, row, device)
        if values is None:
            continue
        problem = problem or _problem(fn, group, names, values, rows)
        if problem is not None:  # told to the next groups
            row[0] = HEARD
    if problem is not None:
        raise CollectiveArgumentError(problem)


def _problem(fn: str, group: Group, names: Sequence[str], mine: Sequence[object],
             rows: list[list[int]]) -> str | None:
    """What ``rows`` (a group's, rank order) show: a refusal, a difference, or ``None``."""
    refused = [r for r, m in enumerate(rows) if m[0] == REFUSED]
    if refused:
        return (f"{fn}: the call was refused on rank{'s' if len(refused) > 1 else ''} "
                f"{_ranks(refused)} of its group of {group.size} (the error there says "
                f"why); every rank makes the same call, with the same model")
    for i, (name, value) in enumerate(zip(names, mine, strict=True)):
        values = [m[1 + i] for m in rows]
        if len(set(values)) > 1:
            return (f"{fn}: every rank of a group of {group.size} must call it with the same "
                    f"model and arguments; {_differ(name, value, values, group.rank)}")
    if any(m[0] == HEARD for m in rows):
        return (f"{fn}: the call was refused, or differs, on another rank of the mesh (the "
                f"errors there say which); every rank makes the same call, with the same "
                f"model")
    return None


def structure(model: nn.Module) -> str:
    """What ``model`` is made of, as text (not its values).

    Each module's name, class and settings (the values of its ``__constants__``: a
    convolution's kernel, stride, padding mode...), and each parameter's and buffer's name,
    shape and dtype.
    """
    modules = [(name, type(m).__qualname__,
                [(c, _setting(getattr(m, c, None))) for c in getattr(m, "__constants__", ())])
               for name, m in model.named_modules(remove_duplicate=False)]
    tensors = [(n, "uninitialized" if is_lazy(t) else tuple(t.shape), str(t.dtype)) for n, t in
               [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    return repr((modules, tensors))


def _setting(value: object) -> str:
    """A module setting as text: plain values as they are, anything else by its type.

    (The ``repr`` of an object may hold its memory address, which differs between
    processes.)
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"({', '.join(_setting(v) for v in value)})"
    return type(value).__qualname__


def code_of(value: object) -> int:
    """A value as one int64 to exchange.

    An int as it is (below 2**62 in size); anything else a 62-bit hash of its text
    (non-negative).
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**62:
        return value
    return int.from_bytes(hashlib.blake2b(_text(value).encode(), digest_size=8).digest(),
                          "little") >> 2


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _differ(name: str, mine: object, values: list[int], rank: int) -> str:
    """How ``values`` (rank order) of the fact ``name`` differ, for the error."""
    if isinstance(mine, int) and not isinstance(mine, bool):
        return f"they differ in {name}: {values} (rank order)"
    others = [r for r, v in enumerate(values) if v != values[0]]
    text = _text(mine)
    shown = f" (this rank, {rank}: {text})" if len(text) <= 40 else ""
    return (f"{name} differ between rank 0 and rank{'s' if len(others) > 1 else ''} "
            f"{_ranks(others)}{shown}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
