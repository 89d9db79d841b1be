"""Every rank's `pipeline` call compared before any stage is cut.

Each rank cuts the model by its own arguments: ranks given other ``microbatches``, another
schedule or other ``virtual_stages`` would wait for transfers that never come (a hang until
the group's timeout), and ranks given another ``split`` or another model would run blocks
twice or not at all (a silently wrong loss). One exchange of a few integers at build time
compares them; a rank whose own call was refused tells the others, so that every rank
raises instead of going on to a first step that waits for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from tensorpar.comm._comm import exchange_ints
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError
from tensorpar.pipeline.schedules import SCHEDULES
from tensorpar.pipeline.stages import StageSpec
from tensorpar.placeholder import FORMAT_VERSION

__all__ = ["FIELDS", "agree_on_build", "build_facts"]

FIELDS = ("microbatches", "schedule", "virtual_stages", "loss_reduction", "loss_fn given",
          "tensorpar wire format", "blocks per stage", "model's parameters")
"""What every rank's call must agree on, in the order of `build_facts`."""

_SHOWN_AS_IS = {"microbatches", "virtual_stages", "tensorpar wire format"}


def build_facts(model: nn.Module, *, microbatches: int, schedule: str, virtual_stages: int,
                loss_reduction: str, loss_fn_given: bool, specs: Sequence[StageSpec]
                ) -> list[int]:
    """This rank's call as integers, in the order of `FIELDS`."""
    return [microbatches, SCHEDULES.index(schedule), virtual_stages,
            ("mean", "sum").index(loss_reduction), int(loss_fn_given), FORMAT_VERSION,
            _hash(repr([s.blocks for s in specs])), _hash(_structure(model))]


def agree_on_build(group: Group, facts: list[int] | None,
                   device: torch.device | None) -> None:
    """Compare ``facts`` with every rank's (one all-gather); raise on every rank.

    ``facts``: `build_facts`, or ``None`` where this rank's own call was refused (the
    caller raises that error after this returns). ``device``: where the model's
    parameters are (the exchange's buffers go with them where the backend allows).

    Raises:
        CollectiveArgumentError: another rank's call was refused, or the ranks' calls differ.
    """
    if group.size == 1:
        return
    row = [0] * (1 + len(FIELDS)) if facts is None else [1, *facts]
    rows = exchange_ints(group, row, device)
    if facts is None:
        return
    refused = [r for r, m in enumerate(rows) if not m[0]]
    if refused:
        raise CollectiveArgumentError(
            f"pipeline: the call was refused on rank{'s' if len(refused) > 1 else ''} "
            f"{', '.join(map(str, refused))} of the pipeline's group (the error there says "
            f"why); every rank calls pipeline with the same model and arguments")
    for i, name in enumerate(FIELDS):
        values = [m[1 + i] for m in rows]
        if len(set(values)) > 1:
            raise CollectiveArgumentError(
                f"pipeline: every rank of the pipeline's group must call it with the same "
                f"model and arguments; {_differ(name, values)}")


def _differ(name: str, values: list[int]) -> str:
    """How ``values`` (rank order) of the field ``name`` differ, for the error."""
    if name in _SHOWN_AS_IS:
        return f"they differ in {name}: {values} (rank order)"
    if name == "schedule":
        return f"they differ in schedule: {[SCHEDULES[v] for v in values]} (rank order)"
    if name == "loss_reduction":
        return (f"they differ in loss_reduction: {[('mean', 'sum')[v] for v in values]} "
                f"(rank order)")
    others = [r for r, v in enumerate(values) if v != values[0]]
    what = {"blocks per stage": "the blocks of each stage (split, or the model's number of "
                                "blocks)",
            "model's parameters": "the model's parameters (names, shapes, dtypes)",
            "loss_fn given": "whether loss_fn is given"}[name]
    return (f"{what} differ between rank 0 and rank{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))}")


def _structure(model: nn.Module) -> str:
    """The names, shapes and dtypes of ``model``'s parameters and buffers."""
    return repr([(n, tuple(t.shape), str(t.dtype)) for n, t in [
        *model.named_parameters(remove_duplicate=False), *model.named_buffers()]])


def _hash(text: str) -> int:
    """A 62-bit hash of ``text`` (it fits an int64)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
