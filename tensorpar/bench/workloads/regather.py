"""Sequence parallelism's regather mode: the backward all-gather overlapped with compute, or not.

``SequenceGather(regather=True)`` keeps only this rank's slice of a column layer's input and
all-gathers it again in backward. With the model's ``SequenceShards.overlap`` (the default)
that all-gather is launched before the first column layer's input gradient and waited for
only before its weight gradient; without, it runs synchronously between the two. Timed side
by side, in interleaved rounds, paired within each round:

- ``step_sync``, ``step_overlap``, ``step_sync_again`` (in this order in every round, one
  model, its ``overlap`` switched between the cases): one forward+backward of the Llama
  stack of `tensorpar.bench.workloads.sequence` (`SIZES`), parallelised with
  ``plan_from_transformers(model, sequence_parallel="regather")``; the synchronous step is
  timed twice, before and after the overlapped one (the run's noise, and the cost of the
  position in the round);
- ``layer_sync``, ``layer_overlap``, ``layer_sync_again``: the backward alone of one
  regathered column layer, the MLP's gate and up projections together (hidden -> 2 x
  intermediate, this rank's share of the features), to the gathered input and the weight
  (`torch.autograd.grad`: the gather's reduce-scatter is left out); the forward runs before
  the timer starts.

Both ways compute the same numbers, bit for bit (checked first).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["run_rank"]


def _shards(model: nn.Module) -> Any:
    """The model's `SequenceShards` (every sequence-parallel layer holds the same one)."""
    from tensorpar.nn.sequence import SequenceShards

    for module in model.modules():
        shards = getattr(module, "sequence", None)
        if isinstance(shards, SequenceShards):
            return shards
    raise ValueError("regather.run_rank: the model has no sequence-parallel layer")


Forward = Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]
"""A forward returning its output and the tensors to differentiate it with respect to."""


def _switched(shards: Any, overlap: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        shards.overlap = overlap
        return fn()
    return call


def _layer(sizes: dict[str, int]) -> tuple[Any, Forward]:
    """One regathered column layer: its `SequenceShards` and its forward."""
    from tensorpar.comm._group import resolve_group
    from tensorpar.nn.sequence import SequenceShards, column_on_gathered

    world, rank = dist.get_world_size(), dist.get_rank()
    features = 2 * sizes["intermediate"]  # gate and up, read from one gathered input
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(features, sizes["hidden"], generator=g).tensor_split(world)[rank]
    weight = weight.clone().requires_grad_()
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=g)
    shards = SequenceShards(resolve_group(None), dim=1)
    piece = shards.split(x).requires_grad_()

    def forward() -> tuple[torch.Tensor, list[torch.Tensor]]:
        whole = shards.gather(piece, partial_grad=True, regather=True)
        return column_on_gathered(whole, weight, None, shards), [whole, weight]
    return shards, forward


def _time_backwards(cases: dict[str, Forward], rounds: int, warmup: int = 2
                    ) -> dict[str, list[float]]:
    """Seconds of each case's backward per round (the slowest rank's); forwards untimed."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + rounds):
        for name, forward in cases.items():
            out, inputs = forward()
            grad = torch.ones_like(out)
            dist.barrier()
            start = time.perf_counter()
            torch.autograd.grad(out, inputs, grad)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                samples[name].append(elapsed.item())
    return samples


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):
            raise AssertionError(f"regather.run_rank: {what} {i} differs with and without "
                                 f"overlap")


def run_rank(rounds: int, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Time the regather with and without overlap; every rank returns the same figures.

    Args:
        rounds: timed rounds (each runs every case once).
        sizes: the model and batch (`tensorpar.bench.workloads.sequence.SIZES` when ``None``).

    Returns:
        Median seconds of each case, the paired ratios (medians over rounds of the ratio
        within a round) of the overlapped case to the synchronous one before it
        (``step_overlap/step_sync``, ``layer_overlap/layer_sync``) and after it
        (``.../step_sync_again``, ``.../layer_sync_again``), and of the two synchronous
        ones (``step_sync_again/step_sync``, ``layer_sync_again/layer_sync``), with ``tp``,
        ``rounds`` and ``sizes``.
    """
    from tensorpar.bench.workloads._timing import time_side_by_side
    from tensorpar.bench.workloads.sequence import SIZES, _loss, _model
    from tensorpar.nn import plan_from_transformers
    from tensorpar.nn.convert import parallelize

    sizes = dict(SIZES if sizes is None else sizes)
    ids = torch.randint(sizes["vocab"], (sizes["batch"], sizes["seq"]),
                        generator=torch.Generator().manual_seed(1))
    model = _model(sizes)
    model = parallelize(model, plan_from_transformers(model, sequence_parallel="regather"))
    shards = _shards(model)

    def step() -> list[torch.Tensor]:
        loss = _loss(model, ids)
        loss.backward()
        out = [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]
        model.zero_grad(set_to_none=True)
        return out

    _same(_switched(shards, True, step)(), _switched(shards, False, step)(), "step: tensor")
    steps = time_side_by_side(
        {"step_sync": _switched(shards, False, step),
         "step_overlap": _switched(shards, True, step),
         "step_sync_again": _switched(shards, False, step)},
        rounds=rounds, pairs=(("step_overlap", "step_sync"), ("step_overlap", "step_sync_again"),
                              ("step_sync_again", "step_sync")))
    layer_shards, forward = _layer(sizes)
    grads = []
    for overlap in (True, False):
        out, inputs = _switched(layer_shards, overlap, forward)()
        grads.append(list(torch.autograd.grad(out, inputs, torch.ones_like(out))))
    _same(grads[0], grads[1], "layer: gradient")
    samples = _time_backwards({"layer_sync": _switched(layer_shards, False, forward),
                               "layer_overlap": _switched(layer_shards, True, forward),
                               "layer_sync_again": _switched(layer_shards, False, forward)},
                              rounds)
    result = {name: statistics.median(v) for name, v in samples.items()}
    for case, base in (("layer_overlap", "layer_sync"), ("layer_overlap", "layer_sync_again"),
                       ("layer_sync_again", "layer_sync")):
        result[f"{case}/{base}"] = statistics.median(
            a / b for a, b in zip(samples[case], samples[base], strict=True))
    return {"table": "regather", "tp": dist.get_world_size(), "rounds": rounds,
            "sizes": sizes, **steps, **result}
