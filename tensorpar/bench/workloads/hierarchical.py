"""Hierarchical vs flat all-reduce on a simulated cluster with a rate-limited network.

`run_cluster` builds a `SimulatedCluster` (2 machines x 2 ranks by default) and runs this
file on it with ``torchrun``; every rank runs `rank_main`. For each size it times, in
interleaved rounds, the flat ``torch.distributed.all_reduce`` and the hierarchical
all-reduce (pipelined, and in one slice), and reads each machine's link byte counters around
every call. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorpar.bench.workloads import reducer_cluster
from tensorpar.bench.workloads._timing import format_table
from tensorpar.hierarchical import hierarchical_all_reduce
from tensorpar.hierarchical.topology import Topology
from tensorpar.testing.cluster import SimulatedCluster, link_bytes

__all__ = ["CASES", "rank_main", "run_cluster", "suite"]

CASES = ("flat", "hierarchical", "hierarchical_one_slice")
"""What is timed: ``dist.all_reduce``; `hierarchical_all_reduce` with pipeline slices of
``slice_mib``; and in one slice (the three stages one after another)."""

_MARKER = "TENSORPAR-BENCH-RESULT "


def run_cluster(*, mib: Sequence[float], rounds: int, link: str = "500mbit",
                machines: int = 2, ranks_per_machine: int = 2, slice_mib: float = 8.0,
                timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run the benchmark on a fresh simulated cluster and return rank 0's figures.

    Args:
        mib: payload sizes in MiB (float32 elements).
        rounds: timed rounds per size (after one warm-up round).
        link: each machine's link rate (``tc`` notation).
        machines: simulated machines.
        ranks_per_machine: ranks on each machine.
        slice_mib: the pipeline's slice size in MiB.
        timeout: seconds for the whole job.

    Returns:
        One dict per size: median seconds per call and median link bytes each machine sent
        per call (the largest over machines), for every case in `CASES`.

    Raises:
        ClusterError: the cluster could not be built, or the job failed or timed out.
    """
    with SimulatedCluster(machines, ranks_per_machine, link) as cluster:
        result = cluster.run(__file__, "--mib", *mib, "--rounds", rounds, "--slice-mib",
                             slice_mib, timeout=timeout).check()
    for line in result.machines[0].output.splitlines():
        if line.startswith(_MARKER):
            rows: list[dict[str, Any]] = json.loads(line[len(_MARKER):])
            return [{"link": link, "machines": machines,
                     "ranks_per_machine": ranks_per_machine, **row} for row in rows]
    raise RuntimeError(f"hierarchical benchmark: rank 0 printed no result; its output:\n"
                       f"{result.machines[0].output[-4000:]}")


def suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``python -m tensorpar.bench hierarchical``: run `run_cluster` and print the table.

    Args:
        args: the command line's ``mib``, ``rounds``, ``link``, ``slice_mib``, ``timeout``.

    Returns:
        The figures of `run_cluster`.
    """
    rows = run_cluster(mib=args.mib, rounds=args.rounds, link=args.link,
                       slice_mib=args.slice_mib, timeout=args.timeout)
    _print_table(rows, args)
    if args.skip_reducer:
        return rows
    end_to_end = reducer_cluster.run_cluster(
        link=args.link, machines=2, ranks_per_machine=2, rounds=args.reducer_rounds,
        variants=reducer_cluster.HIERARCHICAL_VARIANTS, timeout=args.timeout)
    _print_reducer_table(end_to_end, args)
    return [*rows, {"table": "reducer", **end_to_end}]


def _print_reducer_table(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(reducer_cluster.variant_table(r, reducer_cluster.HIERARCHICAL_VARIANTS, "tensorpar"))
    print(f"(the reducer end to end on the same 2 x 2 cluster, {args.link} links: "
          f"{r['params']:,} parameters, batch {reducer_cluster.BATCH} per rank, forward + "
          f"backward + averaging; median of {args.reducer_rounds} rounds, slowest rank; "
          f"limit = max(no_comm, the fastest all-reduce of every gradient timed alone: "
          f"flat or tensorpar's hierarchical one) = {r['limit'] * 1e3:.1f} ms)")


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(format_table(
        ["size", "flat ms", "hier ms", "hier/flat", "1-slice ms", "1-slice/flat",
         "flat MB sent", "hier MB sent", "sent hier/flat"],
        [[f"{r['mib']:g} MiB", f"{r['flat'] * 1e3:.0f}", f"{r['hierarchical'] * 1e3:.0f}",
          f"{r['hierarchical'] / r['flat']:.2f}", f"{r['hierarchical_one_slice'] * 1e3:.0f}",
          f"{r['hierarchical_one_slice'] / r['flat']:.2f}", f"{r['flat_tx'] / 1e6:.1f}",
          f"{r['hierarchical_tx'] / 1e6:.1f}", f"{r['hierarchical_tx'] / r['flat_tx']:.3f}"]
         for r in rows]))
    first = rows[0] if rows else {}
    print(f"(simulated cluster of {first.get('topology', '?')}, {args.link} links, gloo; "
          f"median of {args.rounds} rounds, slowest rank. hier: pipelined in "
          f"{args.slice_mib:g} MiB slices; 1-slice: the three stages one after another. "
          f"MB sent: bytes each machine sent over its link per call (kernel counters, "
          f"headers included; the busiest machine))")


def _measure(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, Any]:
    """Median time (slowest rank) and link bytes sent (busiest machine) per call."""
    samples: dict[str, list[list[float]]] = {name: [] for name in cases}
    for i in range(1 + rounds):
        for name, fn in cases.items():
            dist.barrier()
            tx0, rx0 = link_bytes()
            dist.barrier()  # every rank has read the counters before any rank sends
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            dist.barrier()  # every machine's traffic for this call is done
            tx1, rx1 = link_bytes()
            row = torch.tensor([elapsed, tx1 - tx0, rx1 - rx0], dtype=torch.float64)
            dist.all_reduce(row, op=dist.ReduceOp.MAX)
            if i > 0:
                samples[name].append(row.tolist())
    result: dict[str, Any] = {}
    for name, rows in samples.items():
        result[name] = statistics.median(r[0] for r in rows)
        result[f"{name}_tx"] = statistics.median(r[1] for r in rows)
        result[f"{name}_rx"] = statistics.median(r[2] for r in rows)
    return result


def _check_sums(topology: Topology, slice_bytes: int) -> None:
    """The hierarchical all-reduce, sliced and in one slice, gives the flat one's sum.

    On two and a half slices and a tail (small integers: float32 sums them exactly), before
    anything is timed.
    """
    numel = int(2.5 * slice_bytes) // 4 + 3
    x = torch.arange(numel, dtype=torch.float32) % 7 + dist.get_rank()
    want = x.clone()
    dist.all_reduce(want)
    for slice_size in (slice_bytes, numel * 4):
        got = x.clone()
        hierarchical_all_reduce(got, topology, slice_bytes=slice_size)
        if not torch.equal(got, want):
            raise RuntimeError(f"hierarchical benchmark: the hierarchical all-reduce in "
                               f"{slice_size}-byte slices differs from the flat one; not timed")


def _cases(x: torch.Tensor, topology: Topology, slice_bytes: int
           ) -> dict[str, Callable[[], object]]:
    def flat() -> None:
        dist.all_reduce(x)

    def hierarchical() -> None:
        hierarchical_all_reduce(x, topology, slice_bytes=slice_bytes)

    def one_slice() -> None:
        hierarchical_all_reduce(x, topology, slice_bytes=x.numel() * x.element_size())

    return dict(zip(CASES, (flat, hierarchical, one_slice), strict=True))


def rank_main(argv: Sequence[str] | None = None) -> None:
    """Run on every rank of the cluster (started by ``torchrun``); rank 0 prints the figures.

    Args:
        argv: ``--mib SIZES --rounds N --slice-mib S`` (default ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--slice-mib", type=float, required=True)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topology = Topology.detect()
    slice_bytes = int(opts.slice_mib * 2**20)
    _check_sums(topology, slice_bytes)
    rows = []
    for mib in opts.mib:
        x = torch.zeros(int(mib * 2**20) // 4)  # (zeros: summed in place, they stay finite)
        nbytes = x.numel() * 4
        cases = _cases(x, topology, slice_bytes)
        rows.append({"mib": mib, "nbytes": nbytes, "slice_mib": opts.slice_mib,
                     "topology": str(topology), **_measure(cases, opts.rounds)})
        del x, cases
    if dist.get_rank() == 0:
        print(_MARKER + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and "LOCAL_RANK" in os.environ:
    rank_main()
