"""The gradient reducer across simulated machines: `BucketedAllReduce` next to DDP and the limit.

`run_cluster` builds a `SimulatedCluster` (2 machines x 1 rank by default, rate-limited links)
and runs this file on it with ``torchrun``; every rank runs `rank_main`. The workload is an
8.4M-parameter float32 MLP (8 x ``Linear(1024, 1024)`` + GELU, batch 128 per rank), forward +
backward + gradient averaging, no optimizer step. Variants, each on its own copy of the model
(same seed on every rank):

- ``tensorpar``: ``BucketedAllReduce(model, broadcast_buffers=False)`` with default settings;
- ``tensorpar_8mib``: the same with ``bucket_cap_mb=8`` (little left to send after backward);
- ``tensorpar_overlap``: ``bucket_cap_mb=8, overlap_groups=2`` (buckets alternate between two
  process groups, so up to four are on the wire at once);
- ``ddp``: ``DistributedDataParallel(model, broadcast_buffers=False)`` (its defaults: 25 MiB
  buckets, gradients copied into them, where `BucketedAllReduce` keeps them as views);
- ``flatten_at_end``: backward, then one all-reduce of every gradient concatenated;
- ``no_comm``: forward + backward only;
- ``raw_all_reduce``: one all-reduce of a flat tensor as large as all the gradients;
- ``powersgd`` / ``ddp_powersgd``: PowerSGD (rank 1, from the third iteration) through
  ``register_comm_hook`` of tensorpar and of DDP.

Not in the default set (``python -m tensorpar.bench hierarchical`` runs them on 2 x 2):

- ``tensorpar_hierarchical``: ``BucketedAllReduce(..., algorithm="hierarchical")`` with the
  `Topology` detected from torchrun;
- ``raw_hierarchical``: one hierarchical all-reduce of a flat tensor as large as all the
  gradients.

The limit is ``max(no_comm, fastest raw all-reduce)``: what perfect overlap would give.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from tensorpar.bench.workloads._timing import format_table, time_side_by_side
from tensorpar.bench.workloads.reducer import check_parity
from tensorpar.ddp.reducer import BucketedAllReduce
from tensorpar.hierarchical import hierarchical_all_reduce
from tensorpar.hierarchical.topology import Topology
from tensorpar.testing.cluster import SimulatedCluster

__all__ = ["HIERARCHICAL_VARIANTS", "VARIANTS", "rank_main", "run_cluster", "suite",
           "variant_table"]

WIDTH, LAYERS, BATCH = 1024, 8, 128
VARIANTS = ("tensorpar", "tensorpar_8mib", "tensorpar_overlap", "ddp", "flatten_at_end", "no_comm",
            "raw_all_reduce", "powersgd", "ddp_powersgd")
HIERARCHICAL_VARIANTS = ("tensorpar", "tensorpar_hierarchical", "ddp", "no_comm",
                         "raw_all_reduce", "raw_hierarchical")
_MARKER = "TENSORPAR-BENCH-RESULT "
_TENSORPAR: dict[str, dict[str, Any]] = {  # the tensorpar variants' reducer options
    "tensorpar": {}, "tensorpar_8mib": {"bucket_cap_mb": 8.0},
    "tensorpar_overlap": {"bucket_cap_mb": 8.0, "overlap_groups": 2}, "powersgd": {},
    "tensorpar_hierarchical": {"algorithm": "hierarchical"}}


def _model() -> nn.Sequential:
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def _ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel:
    with warnings.catch_warnings():  # newer torch deprecates broadcast_buffers; still honoured
        warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
        return nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)


def _powersgd_state() -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2)


def _flatten_step(model: nn.Module, x: torch.Tensor, world: int) -> None:
    model(x).square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _steps(variants: Sequence[str], options: dict[str, Any], batch: int
           ) -> tuple[dict[str, Callable[[], object]], list[nn.Module], list[BucketedAllReduce]]:
    """Each variant's one-iteration step, the models to zero between rounds, the reducers."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(batch, WIDTH, generator=gen)
    steps: dict[str, Callable[[], object]] = {}
    models: list[nn.Module] = []
    reducers: list[BucketedAllReduce] = []
    needs_topology = {"tensorpar_hierarchical", "raw_hierarchical"} & set(variants)
    topology = Topology.detect() if needs_topology else None  # collective: all ranks alike

    def backward_of(module: nn.Module) -> Callable[[], object]:
        return lambda: module(x).square().mean().backward()

    for v in variants:
        model = _model()
        models.append(model)
        if v in _TENSORPAR:
            extra = _TENSORPAR[v]
            if extra.get("algorithm") == "hierarchical":
                extra = {**extra, "topology": topology}
            reducer = BucketedAllReduce(model, broadcast_buffers=False,
                                        **{**options, **extra})
            if v == "powersgd":
                reducer.register_comm_hook(_powersgd_state(), powerSGD_hook.powerSGD_hook)
            reducers.append(reducer)
            steps[v] = backward_of(model)
        elif v in ("ddp", "ddp_powersgd"):
            ddp = _ddp(model)
            if v == "ddp_powersgd":
                ddp.register_comm_hook(_powersgd_state(), powerSGD_hook.powerSGD_hook)
            steps[v] = backward_of(ddp)
        elif v == "flatten_at_end":
            steps[v] = lambda m=model: _flatten_step(m, x, world)  # type: ignore[misc]
        elif v == "no_comm":
            steps[v] = backward_of(model)
        elif v == "raw_all_reduce":
            flat = torch.zeros(sum(p.numel() for p in model.parameters()))
            steps[v] = lambda flat=flat: dist.all_reduce(flat)  # type: ignore[misc]
        elif v == "raw_hierarchical" and topology is not None:
            flat = torch.zeros(sum(p.numel() for p in model.parameters()))
            steps[v] = lambda flat=flat: hierarchical_all_reduce(  # type: ignore[misc]
                flat, topology)
        else:
            raise ValueError(f"reducer cluster benchmark: unknown variant {v!r}, expected one "
                             f"of {sorted(set(VARIANTS + HIERARCHICAL_VARIANTS))}")
    return steps, models, reducers


_EXACT = ("tensorpar", "tensorpar_8mib", "tensorpar_overlap", "tensorpar_hierarchical", "ddp",
          "flatten_at_end")
"""The variants that average the gradients exactly (PowerSGD compresses them)."""


def rank_main(argv: Sequence[str] | None = None) -> None:
    """Run on every rank of the cluster (started by ``torchrun``); rank 0 prints the figures.

    Args:
        argv: ``--rounds N [--variants V ...] [--options JSON]`` (default ``sys.argv[1:]``);
            ``--options`` are extra keyword arguments for the tensorpar reducers.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--options", default="{}")
    parser.add_argument("--batch", type=int, default=BATCH)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    steps, models, reducers = _steps(opts.variants, json.loads(opts.options), opts.batch)
    if "ddp" in opts.variants:  # the exact variants' gradients equal DDP's, before timing
        check_parity(dict(zip(opts.variants, models, strict=True)), steps,
                     [v for v in opts.variants if v in _EXACT], rtol=1e-4)

    def zero_all() -> None:
        for m in models:
            m.zero_grad(set_to_none=True)

    times = time_side_by_side({"zero_grad": zero_all, **steps}, rounds=opts.rounds, warmup=3)
    for reducer in reducers:
        reducer.remove()
    params = sum(p.numel() for p in models[0].parameters())
    if dist.get_rank() == 0:
        print(_MARKER + json.dumps({"params": params, "world_size": dist.get_world_size(),
                                    **times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_cluster(*, link: str, machines: int = 2, ranks_per_machine: int = 1, rounds: int = 11,
                variants: Sequence[str] = VARIANTS, options: dict[str, Any] | None = None,
                batch: int = BATCH, timeout: float = 1800.0) -> dict[str, Any]:
    """Run the benchmark on a fresh simulated cluster and return rank 0's figures.

    Args:
        link: each machine's link rate (``tc`` notation).
        machines: simulated machines.
        ranks_per_machine: ranks on each machine.
        rounds: timed rounds (after three warm-up rounds).
        variants: the variants to time (see the module's docstring).
        options: extra keyword arguments for the tensorpar reducers.
        batch: rows per rank; the compute grows with it and the gradients do not (the
            default 128 is communication-bound at 1 Gbit/s, about 640 balanced).
        timeout: seconds for the whole job.

    Returns:
        Median seconds per iteration of every variant (slowest rank), ``params``,
        ``world_size``, ``link``, ``limit`` (``max(no_comm, fastest raw all-reduce)``) and
        ``<variant>_over_limit`` for each variant.

    Raises:
        ClusterError: the cluster could not be built, or the job failed or timed out.
        RuntimeError: rank 0 printed no result.
    """
    with SimulatedCluster(machines, ranks_per_machine, link) as cluster:
        result = cluster.run(__file__, "--rounds", rounds, "--variants", *variants,
                             "--options", json.dumps(options or {}), "--batch", batch,
                             timeout=timeout).check()
    for line in result.machines[0].output.splitlines():
        if line.startswith(_MARKER):
            row: dict[str, Any] = {"link": link, "machines": machines, "batch": batch,
                                   "ranks_per_machine": ranks_per_machine,
                                   **json.loads(line[len(_MARKER):])}
            raws = [row[k] for k in ("raw_all_reduce", "raw_hierarchical") if k in row]
            if "no_comm" in row and raws:
                row["limit"] = max(row["no_comm"], min(raws))
                for v in variants:
                    row[f"{v}_over_limit"] = row[v] / row["limit"]
            return row
    raise RuntimeError(f"reducer cluster benchmark: rank 0 printed no result; its output:\n"
                       f"{result.machines[0].output[-4000:]}")


_ALONE = (": a flat dist.all_reduce or, where timed, tensorpar's own hierarchical one, since "
          "torch has no two-level all-reduce to time; the limit is as good as the faster")


def variant_table(row: dict[str, Any], variants: Sequence[str], baseline: str) -> str:
    """The table of `run_cluster`'s ``row``: time, over the limit, over ``baseline``."""
    return format_table(["variant", "ms / iteration", "/ limit", f"/ {baseline}"],
                        [[v, f"{row[v] * 1e3:.1f}", f"{row[f'{v}_over_limit']:.2f}",
                          f"{row[v] / row[baseline]:.2f}"] for v in variants])


def suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``python -m tensorpar.bench reducer --cluster MxR --link RATE``: run and print the table.

    Args:
        args: the command line's ``cluster`` (``"2x1"``), ``link``, ``batch``, ``rounds``,
            ``timeout``.

    Returns:
        The figures of `run_cluster`, as a one-element list.
    """
    machines, _, per_machine = str(args.cluster).partition("x")
    if not (machines.isdigit() and per_machine.isdigit()):
        raise ValueError(f"reducer: --cluster={args.cluster!r}, expected MACHINESxRANKS "
                         f"(e.g. 2x1)")
    link = args.link or "1gbit"
    batch = getattr(args, "batch", None) or BATCH
    r = run_cluster(link=link, machines=int(machines), ranks_per_machine=int(per_machine),
                    rounds=args.rounds, batch=batch, timeout=args.timeout)
    print(variant_table(r, VARIANTS, "ddp"))
    print(f"(simulated cluster {args.cluster}, {link} links, gloo; {r['params']:,} parameters "
          f"(8 x Linear({WIDTH}, {WIDTH}) + GELU), batch {batch} per rank; median of "
          f"{args.rounds} rounds, slowest rank; limit = max(no_comm, the fastest all-reduce "
          f"of every gradient timed alone{_ALONE}) = {r['limit'] * 1e3:.1f} ms)")
    return [r]


if __name__ == "__main__" and "LOCAL_RANK" in os.environ:
    rank_main()
