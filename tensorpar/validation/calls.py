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
from collections.abc import Sequence

import torch
from torch import nn

from tensorpar.comm._comm import exchange_ints
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError

__all__ = ["Fact", "agree_on_call", "structure"]

Fact = tuple[str, int | str]
"""A fact of a call: its name in messages and its value (an int is shown as it is; a
string travels as a hash, and each rank shows its own)."""


def agree_on_call(fn: str, groups: Sequence[Group], facts: Sequence[Fact] | None,
                  device: torch.device | None, *, n_facts: int) -> None:
    """Compare ``facts`` with every rank's over each of ``groups``; raise on every rank.

    ``facts``: this rank's, or ``None`` where its own call was refused (the caller raises
    that error after this returns); ``n_facts``: how many every rank gives (a refused rank
    sends as many integers). ``device``: where the call's tensors are (the exchange's
    buffers go with them where the backend allows).

    Raises:
        CollectiveArgumentError: another rank's call was refused, or the calls differ.
    """
    row = [0] * (1 + n_facts) if facts is None else [1, *(_code(v) for _, v in facts)]
    for group in groups:
        if group.size == 1:
            continue
        rows = exchange_ints(group, row, device)
        if facts is None:
            continue
        refused = [r for r, m in enumerate(rows) if not m[0]]
        if refused:
            raise CollectiveArgumentError(
                f"{fn}: the call was refused on rank{'s' if len(refused) > 1 else ''} "
                f"{_ranks(refused)} of its group of {group.size} (the error there says "
                f"why); every rank makes the same call, with the same model")
        for i, (name, value) in enumerate(facts):
            values = [m[1 + i] for m in rows]
            if len(set(values)) > 1:
                raise CollectiveArgumentError(
                    f"{fn}: every rank of a group of {group.size} must call it with the same "
                    f"model and arguments; {_differ(name, value, values, group.rank)}")


def structure(model: nn.Module) -> str:
    """What ``model`` is made of, as text (not its values).

    Each module's name, class and settings (the values of its ``__constants__``: a
    convolution's kernel, stride, padding mode...), and each parameter's and buffer's name,
    shape and dtype.
    """
    modules = [(name, type(m).__qualname__,
                [(c, repr(getattr(m, c, None))) for c in getattr(m, "__constants__", ())])
               for name, m in model.named_modules(remove_duplicate=False)]
    tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in [
        *model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    return repr((modules, tensors))


def _code(value: int | str) -> int:
    if isinstance(value, str):  # a 62-bit hash: it fits an int64
        return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(),
                              "little") >> 2
    return int(value)


def _differ(name: str, mine: int | str, values: list[int], rank: int) -> str:
    """How ``values`` (rank order) of the fact ``name`` differ, for the error."""
    if not isinstance(mine, str):
        return f"they differ in {name}: {values} (rank order)"
    others = [r for r, v in enumerate(values) if v != values[0]]
    shown = f" (this rank, {rank}: {mine})" if len(mine) <= 40 else ""
    return (f"{name} differ between rank 0 and rank{'s' if len(others) > 1 else ''} "
            f"{_ranks(others)}{shown}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
