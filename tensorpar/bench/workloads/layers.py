"""Tensor-parallel forward+backward: tensorpar vs DTensor vs a dense single process vs the floor.

Besides wall time, each implementation's CPU time on the calling thread is reported: the
work it does itself (Python, dispatch, kernels on CPU), without the time spent blocked waiting
for the other ranks, which on a latency-bound workload hides the difference.

The floor is what no implementation can beat on these ranks: this rank's share of the dense
compute (the same layers with shard-sized weights, no communication) plus the raw
``dist.all_reduce`` calls that tensor parallelism needs on the same bytes (one in forward
and one in backward per row-parallel layer), run back to back. It is timed twice, as two
cases of the same run: the spread between the two is the run's noise. ``interleaved`` is
the same compute and the same raw calls placed where tensor parallelism needs them
(between the layers): hand-written tensor parallelism without a library, the reference for
host work, since blocking on a collective between layers costs CPU that the floor's calls,
back to back, do not. Two controls measure that cost without any communication:
``compute`` (the floor's compute alone) and ``compute_sleeping`` (the same compute, the
thread sleeping 50 us at each point where tensor parallelism blocks).

With ``compile`` set, tensorpar's and DTensor's models are also timed compiled
(``torch.compile`` with that backend, e.g. ``"inductor"``), each compiled once before the timed
rounds: ``tensorpar_compiled`` and ``dtensor_compiled``.

With ``profile`` > 0, each rank then profiles (``cProfile``) a few steps of tensorpar and of
the floor and reports the functions with the most time of their own, per step.
"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from tensorpar._torch import reset_compiler
from tensorpar.nn.convert import parallelize

__all__ = ["profile_steps", "run_rank", "WORKLOADS"]

# name -> (blocks, dim, hidden, batch, sequence or 0 for an MLP stack)
WORKLOADS: dict[str, tuple[int, int, int, int, int]] = {
    "mlp-compute": (2, 1024, 4096, 64, 0),
    "mlp-dispatch": (8, 64, 256, 8, 0),
    "transformer": (1, 256, 1024, 4, 64),
}
HEAD_DIM = 32


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(x)))
        return out


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False)
                                                 for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (rearrange(p(h), "b t (h d) -> b h t d", d=HEAD_DIM)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(rearrange(a, "b h t d -> b t (h d)"))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


def _model(workload: str, dim: int, hidden: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    block = AttentionBlock if workload == "transformer" else MLPBlock
    return nn.Sequential(*[block(dim, hidden) for _ in range(blocks)])


def _plan(workload: str, blocks: int) -> dict[str, str]:
    plan = {f"{i}.up": "colwise" for i in range(blocks)}
    plan |= {f"{i}.down": "rowwise" for i in range(blocks)}
    if workload == "transformer":
        plan |= {f"{i}.{p}_proj": "colwise" for i in range(blocks) for p in "qkv"}
        plan |= {f"{i}.o_proj": "rowwise" for i in range(blocks)}
    return plan


def _dtensor_model(workload: str, dim: int, hidden: int, blocks: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    plan = {k: styles[v] for k, v in _plan(workload, blocks).items()}
    return parallelize_module(_model(workload, dim, hidden, blocks), mesh, plan)


def _shard_model(workload: str, dim: int, hidden: int, blocks: int) -> nn.Module:
    """The dense layers at this rank's shard sizes (same FLOPs as one rank's share)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local_hidden = len(torch.tensor_split(torch.empty(hidden), world)[rank])
    if workload != "transformer":
        return _model(workload, dim, local_hidden, blocks)
    heads = len(torch.tensor_split(torch.empty(dim // HEAD_DIM), world)[rank])
    model = _model(workload, dim, local_hidden, blocks)
    for block in model:
        assert isinstance(block, AttentionBlock)
        block.q_proj, block.k_proj, block.v_proj = (nn.Linear(dim, heads * HEAD_DIM, bias=False)
                                                    for _ in range(3))
        block.o_proj = nn.Linear(heads * HEAD_DIM, dim)
    return model


def _interleaved_step(workload: str, local: nn.Module, step: Callable[[nn.Module], None],
                      wait: Callable[[], object]) -> Callable[[], None]:
    """The floor's compute calling ``wait`` where tensor parallelism waits for a collective.

    After every row-parallel layer in forward, and in backward once per input of the
    column-parallel layers (q, k and v share theirs). With ``wait`` a raw
    ``dist.all_reduce`` of a side buffer of the activations' shape, this is the reference
    for host work: every tensor-parallel implementation has to block on its collectives
    between layers, and a blocking call costs CPU to wake up from, which the floor's calls,
    back to back after the compute, pay less. With ``wait`` a short sleep, it measures that
    cost with no communication at all.
    """
    plan = _plan(workload, 1)
    seen: set[int] = set()

    def reduce_in_backward(grad: torch.Tensor) -> torch.Tensor:
        wait()
        return grad

    def column_input(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if id(args[0]) not in seen and args[0].requires_grad:
            seen.add(id(args[0]))
            args[0].register_hook(reduce_in_backward)

    for block in local.children():
        for name, style in plan.items():
            layer = block.get_submodule(name.partition(".")[2])
            if style == "rowwise":
                layer.register_forward_hook(lambda *_: wait())
            else:
                layer.register_forward_pre_hook(column_input)

    def run() -> None:
        seen.clear()
        step(local)

    return run


def profile_steps(fn: Callable[[], object], steps: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by time of their own over ``steps`` calls of ``fn``, per call.

    Each row: ``name`` (``file:line(function)``, paths shortened), ``calls``, ``self_us``
    (time in the function itself) and ``total_us`` (with what it calls), per call of ``fn``.
    Times include the profiler's own overhead, which inflates Python-heavy code most.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [{"name": _short(*key), "calls": nc / steps, "self_us": tt / steps * 1e6,
             "total_us": ct / steps * 1e6} for key, (_, nc, tt, ct, _) in stats.items()]
    rows.sort(key=lambda r: -r["self_us"])
    return rows[:top]


def _short(path: str, line: int, name: str) -> str:
    if path == "~":  # a built-in
        return name
    parts = path.split(os.sep)
    for anchor in ("tensorpar", "torch"):
        if anchor in parts:
            at = len(parts) - 1 - parts[::-1].index(anchor)
            path = "/".join(parts[at:])
            break
    return f"{path}:{line}({name})"


def _compiled_cases(backend: str, workload: str, x: torch.Tensor,
                    step: Callable[[nn.Module], None]) -> dict[str, Callable[[], object]]:
    """The models of tensorpar and DTensor compiled whole (tensorpar with ``fullgraph``).

    Both are compiled (forward and backward) before anything is timed and checked against
    each other, so the timed rounds measure compiled steps only.
    """
    blocks, dim, hidden, _, _ = WORKLOADS[workload]
    reset_compiler()
    models: dict[str, Any] = {"tensorpar_compiled": torch.compile(
                  parallelize(_model(workload, dim, hidden, blocks), _plan(workload, blocks)),
                  backend=backend, fullgraph=True),
              "dtensor_compiled": torch.compile(_dtensor_model(workload, dim, hidden, blocks),
                                                backend=backend)}
    for model in models.values():  # compile forward and backward now, not in the timing
        step(model)
    outs = [model(x) for model in models.values()]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    return {name: functools.partial(step, model) for name, model in models.items()}


def run_rank(workload: str, rounds: int, profile: int = 0, compile: str | None = None
             ) -> dict[str, Any]:
    """Time one forward+backward of each implementation; every rank returns the same figures.

    ``floor`` and ``floor_again`` are the same case timed twice (the run's noise). With
    ``compile`` (a ``torch.compile`` backend), tensorpar and DTensor are also timed compiled.
    With ``profile`` > 0, ``profile`` holds this rank's `profile_steps` of tensorpar and the
    floor (the one figure that differs between ranks).
    """
    from tensorpar.bench.workloads._timing import time_side_by_side

    blocks, dim, hidden, batch, seq = WORKLOADS[workload]
    shape = (batch, seq, dim) if seq else (batch, dim)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    dense = _model(workload, dim, hidden, blocks)
    ours = parallelize(_model(workload, dim, hidden, blocks),
                                 _plan(workload, blocks))
    theirs = _dtensor_model(workload, dim, hidden, blocks)
    local = _shard_model(workload, dim, hidden, blocks)
    # the all-reduces tensor parallelism cannot do without: one after each row-parallel
    # layer, and one in the backward per input of the column-parallel layers that needs a
    # gradient (not the model's input), counted as the interleaved step waits for them
    waits: list[None] = []  # (a model of its own: the step's hooks stay on it)
    _interleaved_step(workload, _shard_model(workload, dim, hidden, blocks),
                      lambda m: m(x).sum().backward(), lambda: waits.append(None))()
    comm = [torch.zeros(shape) for _ in waits]  # (zeros: summed in place, they stay finite)

    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)  # same computation

    def step(model: nn.Module) -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    def floor() -> None:
        step(local)
        for t in comm:
            dist.all_reduce(t)

    def dense_on_rank_0() -> None:  # one process computing everything; the others wait
        if dist.get_rank() == 0:
            step(dense)

    def interleaved(wait: Callable[[], object]) -> Callable[[], None]:
        return _interleaved_step(workload, _shard_model(workload, dim, hidden, blocks), step,
                                 wait)

    side_buffer = torch.zeros(shape)
    cases: dict[str, Callable[[], object]] = {
        "dense": dense_on_rank_0, "floor": floor, "tensorpar": lambda: step(ours),
        "dtensor": lambda: step(theirs), "floor_again": floor,
        "interleaved": interleaved(lambda: dist.all_reduce(side_buffer)),
        "compute": lambda: step(local),
        "compute_sleeping": interleaved(lambda: time.sleep(50e-6))}
    pairs: tuple[tuple[str, str], ...] = (("tensorpar", "floor"), ("floor_again", "floor"),
                                          ("tensorpar", "dtensor"), ("tensorpar", "interleaved"),
                                          ("interleaved", "floor"))
    if compile is not None:
        cases |= _compiled_cases(compile, workload, x, step)
        pairs += (("tensorpar_compiled", "dtensor_compiled"),
                  ("tensorpar_compiled", "tensorpar"), ("tensorpar_compiled", "floor"))
    times = time_side_by_side(cases, rounds=rounds, cpu=True, pairs=pairs, rotate=True)
    result = {"workload": workload, "tp": dist.get_world_size(), "floor_all_reduces": len(comm),
              **times}
    if profile > 0:
        steps = max(rounds, 10)
        result["profile"] = {name: profile_steps(cases[name], steps, profile)
                             for name in ("tensorpar", "floor")}
    return result
