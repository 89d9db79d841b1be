"""Pipeline schedules: the order in which each rank runs its forwards and backwards.

A schedule is data: for each rank, a list of actions (`Action`: forward or backward of one
microbatch through one of the rank's stages). Every rank computes all ranks' lists the same
way, by playing the schedule out on a clock (forward 1 tick, backward 2): an action starts
only when what it needs has finished on the clock (the previous stage's forward, the next
stage's backward). The order that comes out therefore has a valid global execution, so
blocking receives and posted sends cannot deadlock.

Stages are *virtual*: with ``virtual_stages=V`` over ``P`` ranks there are ``P * V``
stages, stage ``k`` on rank ``k % P`` (round-robin), which is what interleaving needs.

- ``"gpipe"``: every forward, then every backward.
- ``"1f1b"``: after a warm-up, one forward then one backward; a rank holds at most
  ``P - rank`` microbatches' activations (interleaved 1F1B when ``V > 1``: microbatches
  in groups of ``P``, each group through the rank's stages in turn).
- ``"zero-bubble"`` (ZB-H1): 1F1B with each backward split in two, ``B`` (the input's
  gradient, which the previous stage waits for) and ``W`` (the weights' gradients, which
  no one waits for); a rank runs a ``W`` when it has nothing else to run, or when ``cap``
  of them are pending. On its clock F, B and W take a tick each, and ``cap`` (0 to ``P``)
  is the smallest that gives the shortest step. A rank holds at most 1F1B's activations
  plus ``cap`` (until their ``W``). With ``V > 1`` it is interleaved the same way (the
  order of interleaved 1F1B, each backward split): with ``m >= P`` its idle fraction on
  the clock is ``(P - 1) / (3 V m + P - 1)``, the warm-up's hops alone.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from tensorpar.errors import CollectiveArgumentError

__all__ = ["SCHEDULES", "Action", "ScheduleName", "bubble_fraction", "build_schedule",
           "in_order", "render", "timeline"]

ScheduleName = Literal["gpipe", "1f1b", "zero-bubble"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zero-bubble")

FORWARD_TICKS, BACKWARD_TICKS = 1, 2
SPLIT = "zero-bubble"  # the schedule whose backward is B (input) then W (weights)


def ticks(schedule: str, kind: str) -> int:
    """An action's length on the schedule's clock (a split backward's halves: one each)."""
    if kind == "F" or schedule == SPLIT:
        return FORWARD_TICKS
    return BACKWARD_TICKS


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` of ``microbatch`` on ``stage``.

    ``kind``: ``"F"`` (forward), ``"B"`` (backward; under ``"zero-bubble"`` its input half)
    or ``"W"`` (the weights' half of a split backward).

    ``stage`` is the global (virtual) stage index, ``0 <= stage < P * V``.
    """

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"s{self.stage}" if self.stage else "")


def _orders(rank: int, ranks: int, virtual: int, microbatches: int
            ) -> tuple[list[Action], list[Action]]:
    """The rank's forwards and backwards in the order it runs each kind."""
    if virtual == 1:
        return ([Action("F", i, rank) for i in range(microbatches)],
                [Action("B", i, rank) for i in range(microbatches)])
    fwd: list[Action] = []
    bwd: list[Action] = []
    for start in range(0, microbatches, ranks):
        group = range(start, min(start + ranks, microbatches))
        for v in range(virtual):
            fwd.extend(Action("F", i, v * ranks + rank) for i in group)
        for v in reversed(range(virtual)):
            bwd.extend(Action("B", i, v * ranks + rank) for i in group)
    return fwd, bwd


def _limit(schedule: str, rank: int, ranks: int, virtual: int) -> float:
    """How many (microbatch, stage) activations the rank may hold before it must backward."""
    if schedule == "gpipe":
        return math.inf
    return (ranks - rank - 1) * 2 + (virtual - 1) * ranks + 1 if virtual > 1 else ranks - rank


def timeline(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1
             ) -> list[list[tuple[int, Action]]]:
    """Each rank's actions with their start tick on the schedule's clock.

    A rank with both a forward and a backward it may run picks the backward (which frees
    activations) or, played out too, the forward (Megatron's strict alternation after the
    warm-up); the order that finishes first on the clock wins (the backward on a tie).
    ``"zero-bubble"`` is played for each ``cap`` of pending ``W`` (see the module doc).

    Raises:
        CollectiveArgumentError: an unknown schedule, or counts below 1.
    """
    _check(schedule, ranks, microbatches, virtual_stages)
    if schedule == SPLIT:
        plays = [_play(schedule, ranks, microbatches, virtual_stages, False, cap)
                 for cap in range(ranks + 1)]
    else:
        plays = [_play(schedule, ranks, microbatches, virtual_stages, prefer)
                 for prefer in ((False,) if schedule == "gpipe" else (False, True))]
    # the first play of the shortest length: the backward, or the fewest pending W, on a tie
    best = min((rows for rows in plays if rows is not None), key=lambda r: _end(schedule, r),
               default=None)
    if best is None:  # pragma: no cover - every schedule this module makes finishes
        raise RuntimeError(f"pipeline: schedule {schedule!r} does not finish for {ranks} "
                           f"ranks, {microbatches} microbatches, {virtual_stages} virtual "
                           f"stages")
    return best


Rows = list[list[tuple[int, Action]]]


def _end(schedule: str, rows: Rows) -> int:
    return max(t + ticks(schedule, a.kind) for row in rows for t, a in row)


def _check(schedule: str, ranks: int, microbatches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise CollectiveArgumentError(
            f"pipeline: schedule={schedule!r} is not known; expected one of {SCHEDULES}")
    for name, value in (("stages", ranks), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CollectiveArgumentError(f"pipeline: {name} must be an int >= 1, got {value!r}")


def _play(schedule: str, ranks: int, microbatches: int, virtual_stages: int,
          prefer_forward: bool, cap: int = 0) -> Rows | None:
    """Play the schedule out on the clock (``None``: it gets stuck)."""
    split = schedule == SPLIT
    last = ranks * virtual_stages - 1
    orders = [_orders(r, ranks, virtual_stages, microbatches) for r in range(ranks)]
    limits = [_limit(schedule, r, ranks, virtual_stages) for r in range(ranks)]
    done: dict[Action, int] = {}
    nf, nb, nw = [0] * ranks, [0] * ranks, [0] * ranks
    free = [0] * ranks
    out: list[list[tuple[int, Action]]] = [[] for _ in range(ranks)]
    total = (3 if split else 2) * microbatches * virtual_stages
    t = 0

    def finished(a: Action) -> bool:
        return done.get(a, t + 1) <= t

    while any(nf[r] + nb[r] + nw[r] < total for r in range(ranks)):
        if t > 4 * total * ranks * (FORWARD_TICKS + BACKWARD_TICKS) + 8:
            return None
        for r in range(ranks):
            if free[r] > t:
                continue
            fwd, bwd = orders[r]
            f = fwd[nf[r]] if nf[r] < len(fwd) else None
            b = bwd[nb[r]] if nb[r] < len(bwd) else None
            w = bwd[nw[r]]._replace(kind="W") if split and nw[r] < nb[r] else None
            f_ready = f is not None and (f.stage == 0 or finished(f._replace(stage=f.stage - 1)))
            b_ready = b is not None and (
                finished(b._replace(kind="F")) if b.stage == last
                else finished(b._replace(stage=b.stage + 1)))
            if schedule == "gpipe" and f is not None:
                b_ready = False
            pick: Action | None = None
            may_forward = f is not None and nf[r] - nb[r] < limits[r]
            if w is not None and nb[r] - nw[r] > cap:
                pick = w
            elif prefer_forward and may_forward:
                pick = f if f_ready else None
            elif b_ready:
                pick = b
            elif f_ready and may_forward:
                pick = f
            elif w is not None:
                pick = w
            if pick is None:
                continue
            length = ticks(schedule, pick.kind)
            done[pick] = t + length
            free[r] = t + length
            out[r].append((t, pick))
            if pick.kind == "F":
                nf[r] += 1
            elif pick.kind == "B":
                nb[r] += 1
            else:
                nw[r] += 1
        t += 1
    return out


def build_schedule(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1
                   ) -> list[list[Action]]:
    """Each rank's actions, in the order it runs them (see the module docstring)."""
    return [[a for _, a in row] for row in timeline(schedule, ranks, microbatches,
                                                    virtual_stages)]


def in_order(rows: list[list[Action]], ranks: int) -> bool:
    """Whether every rank receives from each peer in the order that peer sends to it.

    A backend that ignores tags (NCCL) pairs the transfers between two ranks in the order
    they are issued; gloo pairs them by tag and needs no such order. True for every
    schedule here except interleaving on 2 ranks (1F1B with an odd number of microbatches,
    zero-bubble with any), where activations and gradients travel the same way between the
    two ranks.
    """
    last = len(rows) and max(a.stage for row in rows for a in row)
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for r, row in enumerate(rows):
        for a in row:
            k, i = a.stage, a.microbatch
            if a.kind == "W":  # the weights' half: nothing travels
                continue
            if a.kind == "F":
                if k > 0:  # the activation of stage k - 1
                    received.setdefault(((k - 1) % ranks, r), []).append(("F", i, k - 1))
                if k < last:
                    sent.setdefault((r, (k + 1) % ranks), []).append(("F", i, k))
            else:
                if k < last:  # the gradient of this stage's output
                    received.setdefault(((k + 1) % ranks, r), []).append(("B", i, k))
                if k > 0:
                    sent.setdefault((r, (k - 1) % ranks), []).append(("B", i, k - 1))
    return all(sent.get(pair) == received.get(pair) for pair in set(sent) | set(received))


def bubble_fraction(ranks: int, microbatches: int, virtual_stages: int = 1, *,
                    schedule: str = "1f1b") -> float:
    """The idle fraction of a step in theory.

    ``(P - 1) / (V * m + P - 1)`` for GPipe and (interleaved) 1F1B; for ``"zero-bubble"``
    the idle fraction of its clock (F, B and W a tick each), ``(P - 1) / (3 V m + P - 1)``
    where the pending ``W`` fill every wait.
    """
    if schedule != SPLIT:
        return (ranks - 1) / (virtual_stages * microbatches + ranks - 1)
    rows = timeline(schedule, ranks, microbatches, virtual_stages)
    return 1 - 3 * microbatches * virtual_stages / _end(schedule, rows)


def render(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> str:
    """A markdown table of the schedule on its clock (one column per tick, ``.`` idle).

    Example:
        >>> print(render("gpipe", 2, 2))
        | rank | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |
        |---|---|---|---|---|---|---|---|---|---|
        | 0 | F0 | F1 | . | . | . | B0 | B0 | B1 | B1 |
        | 1 | . | F0s1 | F1s1 | B0s1 | B0s1 | B1s1 | B1s1 | . | . |
    """
    rows = timeline(schedule, ranks, microbatches, virtual_stages)
    end = _end(schedule, rows)
    lines = ["| rank | " + " | ".join(str(t) for t in range(end)) + " |",
             "|---|" + "---|" * end]
    for r, row in enumerate(rows):
        cells = ["."] * end
        for t, a in row:
            for dt in range(ticks(schedule, a.kind)):
                cells[t + dt] = str(a)
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
