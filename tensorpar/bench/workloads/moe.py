"""One mixture-of-experts layer, forward + backward: expert parallel vs replicated vs the floor.

Three implementations of the same layer (transformers' Mixtral experts, float32) on the same
tokens and routing, timed side by side in interleaved rounds:

- ``expert_parallel``: `ParallelExperts`, each rank holding its block of the experts.
- ``replicated``: the dense experts module on every rank (every expert held and computed
  for this rank's tokens), with transformers' fastest CPU path (``grouped_mm``).
- ``floor``: what no expert-parallel layer can beat on these ranks: this rank's experts'
  compute on the rows it takes (grouped, forward + backward), plus raw
  ``dist.all_to_all_single`` calls of the same bytes: with local tokens the dispatch and
  the return in forward and their mirrors in backward; with replicated tokens the one
  all-to-all each way that sends this rank's per-token sums (forward) and gradient rows
  (backward) to every peer. Timed twice: the spread is the run's noise.

Two token layouts: ``replicated`` (every rank holds every token, the input of a
tensor-parallel block: no dispatch, each rank's experts take their rows locally) and
``local`` (every rank its own tokens, as with data-parallel ranks). Two routings:
``uniform`` (each token's experts drawn uniformly) and ``skewed`` (Zipf-like popularity:
expert 0 gets about a third of the pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tensorpar.nn.experts import ParallelExperts

__all__ = ["SHAPE", "run_rank"]

SHAPE = {"experts": 8, "hidden": 256, "intermediate": 512, "tokens": 1024, "top_k": 2}
"""Default sizes: tokens per rank (``local``) or in all (``replicated``)."""


def _dense(shape: dict[str, int], implementation: str) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    options: dict[str, Any] = {"experts_implementation": implementation}  # (a config kwarg)
    config = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                           num_local_experts=shape["experts"], **options)
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return experts


def _routing(kind: str, tokens: int, experts: int, top_k: int, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    popularity = torch.ones(experts) if kind == "uniform" else \
        1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    index = torch.multinomial(popularity.expand(tokens, -1), top_k, generator=g)
    return index, torch.rand(tokens, top_k, generator=g)


def _counts_table(index_per_rank: list[torch.Tensor], experts: int) -> list[list[int]]:
    return [torch.bincount(i.reshape(-1), minlength=experts).tolist() for i in index_per_rank]


def _traffic(local: bool, routes: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int],
             rank: int, world: int, experts: int) -> tuple[list[int], list[int], list[int]]:
    """Rows this rank sends to and receives from each rank, and its rows per local expert.

    Local tokens: the dispatch (the return mirrors it). Replicated tokens: the per-token
    sums, the rows of the tokens a rank's experts see, to every peer (none to itself).
    """
    lo, hi = starts[rank], starts[rank + 1]
    if local:
        table = _counts_table([i for i, _ in routes], experts)
        send = [sum(table[rank][starts[r]:starts[r + 1]]) for r in range(world)]
        recv = [sum(row[lo:hi]) for row in table]
        return send, recv, [sum(row[e] for row in table) for e in range(lo, hi)]
    index = routes[0][0]
    seen = [int(((index >= starts[r]) & (index < starts[r + 1])).any(1).sum())
            for r in range(world)]
    send = [0 if r == rank else seen[rank] for r in range(world)]
    recv = [0 if r == rank else seen[r] for r in range(world)]
    return send, recv, _counts_table([index], experts)[0][lo:hi]


def run_rank(tokens_layout: str, routing: str, rounds: int,
             shape: dict[str, int] | None = None) -> dict[str, Any]:
    """Time the three implementations; every rank returns the same figures."""
    from tensorpar.bench.workloads._timing import equal_on_every_rank, time_side_by_side
    from tensorpar.nn._expert_route import grouped_linear

    s = {**SHAPE, **(shape or {})}
    rank, world = dist.get_rank(), dist.get_world_size()
    n_exp, hid, k, tokens = s["experts"], s["hidden"], s["top_k"], s["tokens"]
    local = tokens_layout == "local"
    seeds = list(range(world)) if local else [0]
    routes = [_routing(routing, tokens, n_exp, k, seed) for seed in seeds]
    index, weights = routes[rank if local else 0]
    x = torch.randn(tokens, hid, generator=torch.Generator().manual_seed(100 + rank * local))
    ours = ParallelExperts(_dense(s, "eager"), tokens="local" if local else "replicated")
    replicated = _dense(s, "grouped_mm")
    starts = [sum(ours.shard.sizes[:r]) for r in range(world + 1)]
    send, recv, per_expert = _traffic(local, routes, starts, rank, world, n_exp)
    rows = torch.randn(sum(per_expert), hid, requires_grad=True)
    w1, w2 = (ours._param(n).detach().clone().requires_grad_()
              for n in ("gate_up_proj", "down_proj"))
    send_buf, recv_buf = torch.randn(sum(send), hid), torch.randn(sum(recv), hid)
    # replicated: the backward's rows carry the routing weights' gradients too
    grad_send = torch.randn(sum(send), hid + k)

    def floor() -> None:
        if local:  # dispatch
            dist.all_to_all_single(torch.empty(sum(recv), hid), send_buf, recv, send)
        h = grouped_linear(rows, w1, per_expert, None, False)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_linear(torch.nn.functional.silu(gate) * up, w2, per_expert, None, False)
        if local:  # return
            dist.all_to_all_single(torch.empty(sum(send), hid), recv_buf, send, recv)
        else:  # this rank's sums to every peer
            dist.all_to_all_single(torch.empty(sum(recv), hid), send_buf, recv, send)
        y.sum().backward()
        if local:  # the mirrors
            dist.all_to_all_single(torch.empty(sum(recv), hid), send_buf, recv, send)
            dist.all_to_all_single(torch.empty(sum(send), hid), recv_buf, send, recv)
        else:  # this rank's gradient rows to every peer
            dist.all_to_all_single(torch.empty(sum(recv), hid + k), grad_send, recv, send)
        rows.grad = w1.grad = w2.grad = None

    def step(module: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            xr = x.detach().requires_grad_()
            wr = weights.detach().requires_grad_()
            module(xr, index, wr).sum().backward()
            module.zero_grad(set_to_none=True)
        return run

    with torch.no_grad():  # the same outputs before anything is timed
        equal_on_every_rank(ours(x, index, weights), replicated(x, index, weights),
                            "the expert-parallel layer's output")
    cases: dict[str, Callable[[], object]] = {
        "expert_parallel": step(ours), "replicated": step(replicated), "floor": floor,
        "floor_again": floor}
    times = time_side_by_side(cases, rounds=rounds, rotate=True,
                              pairs=(("expert_parallel", "floor"), ("floor_again", "floor"),
                                     ("expert_parallel", "replicated")))
    load = torch.tensor([sum(per_expert)], dtype=torch.float64)
    dist.all_reduce(load, op=dist.ReduceOp.MAX)
    return {"tokens": tokens_layout, "routing": routing, "world_size": world,
            "max_rows": int(load.item()), **times}
