r"""One pipeline-parallel training step: tensorpar's schedules against torch.distributed.pipelining.

The same model (an ``nn.Sequential`` of ``Linear + GELU`` blocks, float32, the same number
of blocks on every rank, cut into contiguous stages of equal size), the same batch and the
same number of microbatches, one step (every forward and backward) timed in interleaved
rounds:

- tensorpar: ``tensorpar.nn.pipeline`` with ``schedule="gpipe"``, ``"1f1b"``, ``"1f1b"``
  with 2 virtual stages per rank (interleaved), ``"zero-bubble"`` (ZB-H1, one stage per
  rank) and ``"zero-bubble"`` with 2 virtual stages per rank;
- torch: ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and, beside
  both zero-bubble cases, ``ScheduleInterleavedZeroBubble`` (torch's zero-bubble schedules
  run 2 stages per rank) over ``PipelineStage``\\ s of the same blocks.

The step time is the slowest rank's. ``compute`` is the time a rank takes for the same
forwards and backwards of its stage(s) on the same microbatches, in its schedule's order,
with no communication (timed in the same round, while the other ranks do the same). The measured
bubble is ``1 - compute / step`` of the rank with the most compute, the stage that sets the
pace: all of its step that is not its own arithmetic counts (idle waits, transfers,
headers, Python overhead). Theory's ``(P - 1) / (V * m + P - 1)`` (zero-bubble:
``(P - 1) / (3 V m + P - 1)``, its clock with F, B and W a tick each) assumes equal stages;
these are not quite equal (the first stage computes no gradient for the batch, the last
computes the loss), so a faster stage also waits for the slower one: the mean over the
ranks of ``1 - compute / step`` (``idle``) counts that too. Both are given for both
libraries. Each is the median of per-round figures; on a small model and a busy machine a
round's compute-only pass can take longer than its step, and the figure then is negative:
it is reported as measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar
from tensorpar.pipeline import Action, bubble_fraction, build_schedule

__all__ = ["CASES", "SHAPE", "run_rank"]

SHAPE = {"width": 1024, "blocks_per_rank": 4, "rows": 64}
"""Default sizes: features, blocks per rank (over its virtual stages), rows per microbatch."""

CASES = (("gpipe", "gpipe", 1, "ScheduleGPipe", 1), ("1f1b", "1f1b", 1, "Schedule1F1B", 1),
         ("interleaved", "1f1b", 2, "ScheduleInterleaved1F1B", 2),
         ("zero-bubble", "zero-bubble", 1, "ScheduleInterleavedZeroBubble", 2),
         ("zero-bubble-interleaved", "zero-bubble", 2, "ScheduleInterleavedZeroBubble", 2))
"""``(name, tensorpar schedule, its virtual stages, torch schedule class, its virtual stages)``."""


def _model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                           for _ in range(blocks)])


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _compute_only(stages: dict[int, nn.Module], actions: list[Action], total_stages: int,
                  xs: list[torch.Tensor], ys: list[torch.Tensor]) -> Callable[[], float]:
    """This rank's forwards and backwards in its schedule's order, no communication: seconds.

    ``stages``: the rank's stage modules by global stage index; ``actions``: the rank's
    schedule. The same arithmetic in the same order as a step (so the same switching
    between stages' weights), with nothing to wait for; a split backward's ``B`` runs the
    whole backward here, and its ``W`` nothing.
    """
    total = sum(x.shape[0] for x in xs)
    grads = [torch.randn_like(x) for x in xs]  # d loss / d output of a stage that is not last

    def run() -> float:
        dist.barrier()
        held: dict[tuple[int, int], torch.Tensor] = {}
        start = time.perf_counter()
        for kind, i, k in actions:
            if kind == "W":
                continue
            if kind == "F":
                # a received activation is a leaf whose gradient goes back; the batch is not
                h = xs[i] if k == 0 else xs[i].detach().requires_grad_()
                out = stages[k](h)
                held[(i, k)] = (F.mse_loss(out, ys[i]) * (xs[i].shape[0] / total)
                                if k == total_stages - 1 else out)
            else:
                out = held.pop((i, k))
                if k == total_stages - 1:
                    out.backward()
                else:
                    out.backward(grads[i])
        elapsed = time.perf_counter() - start
        for stage in stages.values():
            stage.zero_grad()
        return elapsed

    return run


def _check_equal(name: str, ours: Any, dense: nn.Module, theirs: Any, x: torch.Tensor,
                 y: torch.Tensor, first: bool, last: bool, theirs_last: bool) -> None:
    """One step of each: the same batch loss and the same gradients, or raise (untimed)."""
    loss = ours.step(x if first else None, y if last else None)
    losses: list[torch.Tensor] = []
    if first:
        theirs.step(x)
    elif theirs_last:
        theirs.step(target=y, losses=losses)
    else:
        theirs.step()
    found = torch.zeros(2, dtype=torch.float64)  # (each loss lives on one rank)
    if last:
        found[0] = float(loss)
    if theirs_last:
        found[1] = float(torch.stack(losses).detach().mean())
    dist.all_reduce(found)
    theirs_grads = {n: p.grad for n, p in dense.named_parameters()}
    # (where this rank holds a block on both sides: torch's stages of two per rank differ)
    worst = max((float((p.grad - theirs_grads[n]).abs().max())
                 for n, p in ours.named_parameters() if theirs_grads[n] is not None),
                default=0.0)
    worst = _max(max(worst, abs(float(found[0] - found[1])) / max(abs(float(found[1])), 1.0)))
    if worst > 1e-4:
        raise RuntimeError(f"pipeline benchmark, {name}: tensorpar's step and torch's differ "
                           f"by {worst:.3g} (loss or a gradient); not timed")
    ours.zero_grad()
    dense.zero_grad()


def _timed(step: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    return _max(time.perf_counter() - start)


def run_rank(microbatches: int, rounds: int, shape: dict[str, int] | None = None
             ) -> list[dict[str, Any]]:
    """Time each case on this rank's stage(s); every rank returns the same figures."""
    from torch.distributed import pipelining

    shape = {**SHAPE, **(shape or {})}
    torch.set_num_threads(1)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    width, rows = shape["width"], shape["rows"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows * microbatches, width, generator=g)
    y = torch.randn(rows * microbatches, width, generator=g)
    out = []
    for name, schedule, virtual, torch_name, torch_virtual in CASES:
        stages = ranks * virtual
        blocks = shape["blocks_per_rank"] * ranks
        per = blocks // stages
        ours = tensorpar.nn.pipeline(_model(width, blocks), microbatches=microbatches,
                                     schedule=schedule, loss_fn=F.mse_loss,
                                     virtual_stages=virtual)
        dense = _model(width, blocks)
        theirs_total = ranks * torch_virtual
        theirs_per = blocks // theirs_total
        theirs_stages = [pipelining.PipelineStage(
            nn.Sequential(*[dense[i] for i in range(k * theirs_per, (k + 1) * theirs_per)]),
            k, theirs_total, torch.device("cpu")) for k in range(rank, theirs_total, ranks)]
        cls = getattr(pipelining, torch_name)
        theirs = cls(theirs_stages if torch_virtual > 1 else theirs_stages[0],
                     n_microbatches=microbatches, loss_fn=F.mse_loss)
        first, last = rank == 0, rank == (stages - 1) % ranks
        theirs_last = rank == (theirs_total - 1) % ranks

        def ours_step() -> None:
            ours.step(x if first else None, y if last else None)  # noqa: B023
            ours.zero_grad()  # noqa: B023

        def theirs_step() -> None:
            if first:  # noqa: B023
                theirs.step(x)  # noqa: B023
            elif theirs_last:  # noqa: B023
                theirs.step(target=y, losses=[])  # noqa: B023
            else:
                theirs.step()  # noqa: B023
            dense.zero_grad()  # noqa: B023

        alone = _model(width, blocks)  # the same blocks, for the compute-only pass
        compute = _compute_only(
            {k: nn.Sequential(*[alone[i] for i in range(k * per, (k + 1) * per)])
             for k in range(rank, stages, ranks)},
            build_schedule(schedule, ranks, microbatches, virtual)[rank], stages,
            list(torch.tensor_split(x, microbatches)), list(torch.tensor_split(y, microbatches)))
        _check_equal(name, ours, dense, theirs, x, y, first, last, theirs_last)
        for _ in range(2):  # warm-up (torch's stages infer their shapes on the first step)
            ours_step()
            theirs_step()
            compute()
        times: dict[str, list[float]] = {"ours": [], "theirs": [], "compute": [],
                                         "bubble": [], "torch_bubble": [], "idle": [],
                                         "torch_idle": []}
        for r in range(rounds):
            # the three in a rotating order, so that none always follows the same one
            order = [("ours", ours_step), ("theirs", theirs_step), ("compute", None)]
            order = order[r % 3:] + order[:r % 3]
            for key, step in order:
                times[key].append(compute() if step is None else _timed(step))
            busy = times["compute"][-1]  # this rank's; the step time is the slowest rank's
            slowest = _max(busy)
            for key, step_key in (("", "ours"), ("torch_", "theirs")):
                times[f"{key}bubble"].append(1.0 - slowest / times[step_key][-1])
                times[f"{key}idle"].append(_mean(1.0 - busy / times[step_key][-1]))
        ratios = [a / b for a, b in zip(times["ours"], times["theirs"], strict=True)]
        out.append({"case": name, "ranks": ranks, "microbatches": microbatches,
                    "virtual_stages": virtual, "tensorpar": statistics.median(times["ours"]),
                    "torch": statistics.median(times["theirs"]),
                    "paired_ratio": statistics.median(ratios),
                    "compute": _max(statistics.median(times["compute"])),
                    "bubble": statistics.median(times["bubble"]),
                    "torch_bubble": statistics.median(times["torch_bubble"]),
                    "idle": statistics.median(times["idle"]),
                    "torch_idle": statistics.median(times["torch_idle"]),
                    "bubble_theory": bubble_fraction(ranks, microbatches, virtual,
                                                     schedule=schedule)})
    return out
