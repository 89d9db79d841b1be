"""The benchmark suites' drivers: run a suite's ranks, print its tables, return its figures.

`SUITES` maps each suite's name to its driver and `DEFAULTS` holds the options a command
line leaves out; ``python -m tensorpar.bench`` and the ``all`` report both use them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from typing import Any

from tensorpar.bench.workloads._timing import format_table
from tensorpar.testing import run_distributed

__all__ = ["DEFAULTS", "SUITES"]


def _run(args: argparse.Namespace, label: str, fn: Callable[..., Any], world: int,
         *fn_args: Any) -> list[Any]:
    """`run_distributed`, shown as one case by the ``all`` command's progress display."""
    case = getattr(args, "on_case", None)  # set by tensorpar.bench.report
    with case(label) if case is not None else contextlib.nullcontext():
        return run_distributed(fn, world, *fn_args, timeout=args.timeout)


def _scatter_gather(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import scatter_gather

    results = []
    for world in args.world_sizes:
        for mib in args.mib:
            per_rank = _run(args, f"{world} ranks, {mib:g} MiB", scatter_gather.run_rank,
                            world, int(mib * 2**20), args.rounds)
            results.append(per_rank[0])
    rows = [[r["world_size"], f"{r['nbytes'] / 2**20:g} MiB",
             *(f"{r[k] * 1e3:.2f}" for k in ("raw", "raw_alloc", "tensorpar",
                                               "tensorpar_known_meta")),
             *(f"{r[k]:.2f}" for k in ("tensorpar/raw", "tensorpar/raw_alloc",
                                        "tensorpar_known_meta/raw_alloc"))]
            for r in results]
    print(format_table(["ranks", "size", "raw ms", "raw+alloc ms", "tensorpar ms",
                        "known-meta ms", "tp/raw", "tp/raw+alloc", "known-meta/raw+alloc"],
                       rows))
    print("ratios paired: the median over rounds of the two calls' ratio within one round")
    return results


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _collectives(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import collectives

    results: list[dict[str, Any]] = []
    for world in args.world_sizes:
        for mib in args.mib:
            results += _run(args, f"{world} ranks, {mib:g} MiB", collectives.run_rank, world,
                            int(mib * 2**20), args.rounds, args.budget)[0]
    order = ["all_gather", "all_gather (exchange sizes)", "reduce_scatter", "all_reduce",
             "all_reduce (in place)", "all_to_all"]
    rows = sorted((r for r in results if r["table"] == "collectives"),
                  key=lambda r: (order.index(r["collective"]), r["world_size"], r["nbytes"]))
    print(format_table(
        ["collective", "ranks", "size", "calls", "raw ms", "raw prealloc ms", "tensorpar ms",
         "tp/raw", "tp/raw prealloc", "raw again/raw", "paired tp/raw", "paired again/raw"],
        [[r["collective"], r["world_size"], f"{r['nbytes'] / 2**20:.3g} MiB", r["calls"],
          _ms(r["raw"]), _ms(r["raw_prealloc"]), _ms(r["tensorpar"]), _x(r["ratio"]),
          _x(r["ratio_prealloc"]), _x(r["noise"]), _x(r.get("paired_ratio")),
          _x(r.get("paired_noise"))] for r in rows]))
    print("\nMedian per call over back-to-back calls, slowest rank. raw again/raw: the raw call "
          "timed twice, the spread between identical cases. paired: the median over turns of "
          "the two calls' ratio within one turn (drift of the machine's speed cancels).")
    print()
    checked = sorted((r for r in results if r["table"] == "validation"),
                     key=lambda r: (order.index(r["collective"]), r["world_size"], r["nbytes"]))
    print(format_table(
        ["validation", "ranks", "size", "off ms", "on ms", "on/off", "loop off ms",
         "loop on ms", "loop on/off", "paired on/off"],
        [[r["collective"], r["world_size"], f"{r['nbytes'] / 2**20:.3g} MiB", _ms(r["off"]),
          _ms(r["on"]), _x(r["ratio"]), _ms(r["loop_off"]), _ms(r["loop_on"]),
          _x(r["loop_ratio"]), _x(r.get("paired_ratio"))] for r in checked]))
    print("(tensorpar's call with validation mode off and on: call by call as above, and per "
          "call over blocks of up to 20 calls in a row; on adds one small exchange of every "
          "rank's fingerprint before the call)")
    print()
    uneven = [r for r in results if r["table"] == "uneven_all_to_all"]
    print(format_table(
        ["uneven all_to_all splits", "ranks", "size", "padded bytes", "tensorpar ms",
         "native ms", "padded ms", "p2p ms", "tp/native", "padded/native", "p2p/native"],
        [[":".join(str(s) for s in r["splits"]), r["world_size"],
          f"{r['nbytes'] / 2**20:.3g} MiB", f"x{r['padded_nbytes'] / r['nbytes']:.2f}",
          _ms(r["tensorpar"]), _ms(r["native"]), _ms(r["padded"]), _ms(r["p2p"]),
          *(_x(r[f"{case}_over_native"]) for case in ("tensorpar", "padded", "p2p"))]
         for r in uneven]))
    print("(native: the backend's own uneven all_to_all_single, what tensorpar calls for a dim-0 "
          "exchange with sizes; p2p: one isend/irecv per peer; ratios paired: the median over "
          "turns of the two calls' ratio within one turn)")
    return results


def _mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


def _reducer(args: argparse.Namespace) -> list[dict[str, Any]]:
    if getattr(args, "cluster", None):  # across simulated machines (needs root)
        from tensorpar.bench.workloads import reducer_cluster

        return reducer_cluster.suite(args)
    from tensorpar.bench.workloads import reducer

    timings: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    for world in args.world_sizes:
        for name in args.models:
            row = _run(args, f"{world} ranks, {name} time", reducer.run_rank, world, name,
                       args.rounds)[0]
            timings.append({"table": "time", **row})
        for name in args.models:
            for variant in reducer.MEMORY_VARIANTS:  # a fresh call each: one model at a time
                per_rank = _run(args, f"{world} ranks, {name} memory ({variant})",
                                reducer.memory_rank, world, name, variant, 3)
                memory.append({"table": "memory", "model": name, "variant": variant,
                               "world_size": world, "hwm": all(r["hwm"] for r in per_rank),
                               **{k: max(r[k] for r in per_rank)
                                  for k in ("base_kib", "peak_kib", "steady_base_kib",
                                            "steady_kib")},
                               "per_rank": per_rank})
    print(format_table(
        ["ranks", "model", "params", "tensors", "grads MiB",
         *(f"{v} ms" for v in reducer.VARIANTS), "paired tp/ddp", "paired tp default/ddp"],
        [[r["world_size"], r["model"], f"{r['params']:,}", r["tensors"],
          f"{r['grad_bytes'] / 2**20:.1f}", *(_ms(r[v]) for v in reducer.VARIANTS),
          _x(r["tp_over_ddp"]), _x(r["tp_default_over_ddp"])] for r in timings]))
    print()
    exposed = ("tensorpar", "ddp", "per_param", "flatten_at_end")
    print(format_table(
        ["ranks", "model", "raw all_reduce ms", *(f"exposed {v} ms" for v in exposed),
         "exposed tp/raw", "exposed ddp/raw"],
        [[r["world_size"], r["model"], _ms(r["raw_all_reduce"]),
          *(_ms(r[f"exposed_{v}"]) for v in exposed), _x(r["exposed_tensorpar_over_raw"]),
          _x(r["exposed_ddp_over_raw"])] for r in timings]))
    print()
    if not all(m["hwm"] for m in memory):
        print("(/proc/self/clear_refs was not writable: the peak columns show VmRSS after "
              "the iterations, not VmHWM)")
    print(format_table(
        ["ranks", "model", "variant", "start RSS MiB", "peak MiB (build + 3 it)",
         "peak - start MiB", "steady peak MiB (3 more it)", "steady peak - start MiB"],
        [[m["world_size"], m["model"], m["variant"], _mib(m["base_kib"]), _mib(m["peak_kib"]),
          _mib(max(r["peak_kib"] - r["base_kib"] for r in m["per_rank"])),
          _mib(m["steady_kib"]),
          _mib(max(r["steady_kib"] - r["base_kib"] for r in m["per_rank"]))]
         for m in memory]))
    print("(max over ranks; start RSS: after gc.collect() and malloc_trim, before building "
          "the model; RSS also counts freed heap memory that glibc keeps)")
    return timings + memory


def _layers(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import layers

    results = []
    top = getattr(args, "profile", None) or 0
    for tp in args.world_sizes:
        for workload in layers.WORKLOADS:
            results.append(_run(args, f"tp {tp}, {workload}", layers.run_rank, tp, workload,
                                args.rounds, top, getattr(args, "compile", None) or None)[0])
    sequence_rows = _sequence(args)
    rows = [[r["workload"], r["tp"], _ms(r["dense"]), _ms(r["floor"]), _ms(r["tensorpar"]),
             _ms(r["dtensor"]), _x(r["tensorpar"] / r["dtensor"]),
             _x(r["tensorpar"] / r["floor"]), _x(r["floor_again"] / r["floor"]),
             _x(r["tensorpar"] / r["dense"]), _ms(r["tensorpar_cpu"]), _ms(r["floor_cpu"]),
             _ms(r["dtensor_cpu"]), _x(r["tensorpar_cpu"] / r["dtensor_cpu"]),
             _x(r.get("tensorpar/floor")), _x(r.get("floor_again/floor")),
             _x(r.get("tensorpar/dtensor"))]
            for r in results]
    print(format_table(["workload", "tp", "dense ms", "floor ms", "tensorpar ms", "dtensor ms",
                        "tp/dtensor", "tp/floor", "floor again/floor", "tp/dense", "tp CPU ms",
                        "floor CPU ms", "dtensor CPU ms", "tp/dtensor CPU", "paired tp/floor",
                        "paired again/floor", "paired tp/dtensor"], rows))
    print("(forward+backward per step; dense: one process computing everything; floor: this "
          "rank's share of the dense compute + the raw all-reduces of the same bytes, run back "
          "to back; floor again/floor: the floor timed twice, the run's noise; CPU: the "
          "calling thread's CPU time, without time blocked on other ranks; paired: the median "
          "over rounds of the two steps' ratio within one round)")
    compiled = [r for r in results if "tensorpar_compiled" in r]
    if compiled:
        print(format_table(
            ["workload", "tp", "tensorpar ms", "tp compiled ms", "dtensor compiled ms",
             "paired tp compiled/dtensor compiled", "paired tp compiled/tp",
             "paired tp compiled/floor", "tp CPU ms", "tp compiled CPU ms",
             "dtensor compiled CPU ms", "floor CPU ms", "tp compiled CPU/floor CPU"],
            [[r["workload"], r["tp"], _ms(r["tensorpar"]), _ms(r["tensorpar_compiled"]),
              _ms(r["dtensor_compiled"]), _x(r.get("tensorpar_compiled/dtensor_compiled")),
              _x(r.get("tensorpar_compiled/tensorpar")), _x(r.get("tensorpar_compiled/floor")),
              _ms(r["tensorpar_cpu"]), _ms(r["tensorpar_compiled_cpu"]),
              _ms(r["dtensor_compiled_cpu"]), _ms(r["floor_cpu"]),
              _x(r["tensorpar_compiled_cpu"] / r["floor_cpu"])] for r in compiled]))
        print(f"(compiled: torch.compile(backend={args.compile!r}), tensorpar with "
              f"fullgraph=True; the floor is eager; same rounds as the table above)")
    _print_host_work(results)
    _print_sequence(sequence_rows)
    for r in results if top else []:
        for case in ("tensorpar", "floor"):
            print(f"\nprofile of {case}, {r['workload']}, tp {r['tp']} (rank 0, cProfile: "
                  f"per step, sorted by time in the function itself)")
            print(format_table(["function", "calls", "self us", "total us"],
                               [[p["name"], f"{p['calls']:g}", f"{p['self_us']:.0f}",
                                 f"{p['total_us']:.0f}"] for p in r["profile"][case]]))
    return results + sequence_rows


def _print_host_work(results: list[dict[str, Any]]) -> None:
    """Host work per step (thread CPU) against the floor and the interleaved reference."""
    def cpu(r: dict[str, Any], case: str) -> float | None:
        return r.get(f"{case}_cpu")

    def ratio(a: float | None, b: float | None) -> str:
        return _x(a / b) if a is not None and b else "-"

    print()
    print(format_table(
        ["workload", "tp", "tp CPU ms", "tp compiled CPU ms", "interleaved CPU ms",
         "floor CPU ms", "tp/floor CPU", "tp compiled/floor CPU", "interleaved/floor CPU",
         "tp/interleaved CPU", "tp compiled/interleaved CPU", "paired tp/interleaved",
         "compute CPU ms", "sleeping/compute CPU"],
        [[r["workload"], r["tp"], _ms(cpu(r, "tensorpar")), _ms(cpu(r, "tensorpar_compiled")),
          _ms(cpu(r, "interleaved")), _ms(cpu(r, "floor")),
          ratio(cpu(r, "tensorpar"), cpu(r, "floor")),
          ratio(cpu(r, "tensorpar_compiled"), cpu(r, "floor")),
          ratio(cpu(r, "interleaved"), cpu(r, "floor")),
          ratio(cpu(r, "tensorpar"), cpu(r, "interleaved")),
          ratio(cpu(r, "tensorpar_compiled"), cpu(r, "interleaved")),
          _x(r.get("tensorpar/interleaved")), _ms(cpu(r, "compute")),
          ratio(cpu(r, "compute_sleeping"), cpu(r, "compute"))] for r in results]))
    print("(host work: the calling thread's CPU time per step; interleaved: the floor's compute "
          "and raw all-reduces, each call placed between the layers where tensor parallelism "
          "needs it: hand-written tensor parallelism without a library, which blocks between "
          "layers as every implementation must; compute: the floor's compute alone; sleeping: "
          "the same compute sleeping 50 us where tensor parallelism blocks, no communication: "
          "what blocking itself costs the thread on this machine)")


def _sequence(args: argparse.Namespace, sizes: dict[str, int] | None = None
              ) -> list[dict[str, Any]]:
    """The sequence-parallel rows of the layers suite (`tensorpar.bench.workloads.sequence`).

    ``sizes``: the model and batch (`tensorpar.bench.workloads.sequence.SIZES` when ``None``).
    """
    from tensorpar.bench.workloads import sequence

    return [_run(args, f"tp {tp}, llama sequence parallel", sequence.run_rank, tp,
                 args.rounds, sizes)[0] for tp in args.world_sizes]


def _print_sequence(rows: list[dict[str, Any]]) -> None:
    print()
    print(format_table(
        ["workload", "tp", "floor ms", "tensorpar SP ms", "tensorpar TP ms", "dtensor SP ms",
         "paired SP/dtensor SP", "paired SP/floor", "paired SP/TP", "paired again/floor",
         "SP CPU ms", "dtensor SP CPU ms", "floor CPU ms", "SP CPU/dtensor SP CPU"],
        [[r["workload"], r["tp"], _ms(r["floor"]), _ms(r["tensorpar_sp"]),
          _ms(r["tensorpar_tp"]), _ms(r["dtensor_sp"]), _x(r["tensorpar_sp/dtensor_sp"]),
          _x(r["tensorpar_sp/floor"]), _x(r["tensorpar_sp/tensorpar_tp"]),
          _x(r["floor_again/floor"]), _ms(r["tensorpar_sp_cpu"]), _ms(r["dtensor_sp_cpu"]),
          _ms(r["floor_cpu"]), _x(r["tensorpar_sp_cpu"] / r["dtensor_sp_cpu"])]
         for r in rows]))
    sizes = rows[0]["sizes"] if rows else {}
    cores = os.cpu_count() or 1
    print(f"(sequence parallelism on a transformers LlamaModel, {sizes}, float32, "
          f"forward+backward per step; SP / TP: tensorpar with and without sequence "
          f"parallelism; dtensor SP: parallelize_module with SequenceParallel norms; floor: "
          f"this rank's share of the compute + the raw all-gathers, reduce-scatters and "
          f"all-reduces of the same bytes; losses and norm gradients checked against the dense "
          f"model first; {cores} CPU cores: tp > {cores} is oversubscribed)")


def _regather(args: argparse.Namespace, sizes: dict[str, int] | None = None
              ) -> list[dict[str, Any]]:
    """The regather suite: ``sizes`` as in `_sequence`."""
    from tensorpar.bench.workloads import regather

    rows = [_run(args, f"tp {tp}, regather overlap", regather.run_rank, tp, args.rounds,
                 sizes)[0] for tp in args.world_sizes]
    print(format_table(
        ["tp", "step overlap ms", "step sync ms", "paired step overlap/sync",
         "paired step overlap/again", "paired step again/sync", "layer bwd overlap ms",
         "layer bwd sync ms", "paired layer overlap/sync", "paired layer overlap/again",
         "paired layer again/sync"],
        [[r["tp"], _ms(r["step_overlap"]), _ms(r["step_sync"]),
          _x(r["step_overlap/step_sync"]), _x(r["step_overlap/step_sync_again"]),
          _x(r["step_sync_again/step_sync"]), _ms(r["layer_overlap"]), _ms(r["layer_sync"]),
          _x(r["layer_overlap/layer_sync"]), _x(r["layer_overlap/layer_sync_again"]),
          _x(r["layer_sync_again/layer_sync"])] for r in rows]))
    sizes = rows[0]["sizes"] if rows else {}
    print(f"(sequence_parallel='regather' on a transformers LlamaModel, {sizes}, float32; "
          f"overlap: the backward all-gather in flight while the input gradient is computed, "
          f"sync: after it; step: forward+backward; layer bwd: the backward of one column "
          f"layer (gate and up) alone; each round runs sync, overlap, again (sync once more: "
          f"the run's noise); "
          f"paired: median over rounds of the ratio within a round)")
    return rows


def _moe(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import moe

    results = []
    for world in args.world_sizes:
        for layout in ("replicated", "local"):
            for routing in ("uniform", "skewed"):
                results.append(_run(args, f"{world} ranks, {layout} tokens, {routing}",
                                    moe.run_rank, world, layout, routing, args.rounds)[0])
    print(format_table(
        ["tokens", "routing", "ranks", "max rows", "expert parallel ms", "replicated ms",
         "floor ms", "paired ep/floor", "paired again/floor", "paired ep/replicated"],
        [[r["tokens"], r["routing"], r["world_size"], r["max_rows"], _ms(r["expert_parallel"]),
          _ms(r["replicated"]), _ms(r["floor"]), _x(r["expert_parallel/floor"]),
          _x(r["floor_again/floor"]), _x(r["expert_parallel/replicated"])] for r in results]))
    print("(one Mixtral experts layer, forward+backward, float32, sizes in "
          "tensorpar.bench.workloads.moe.SHAPE; max rows: the most token-expert rows any rank "
          "computes; floor: this rank's experts' compute + raw all-to-alls of the same bytes "
          "(local tokens: the dispatch and the return, and their mirrors; replicated tokens: "
          "the per-token sums to every peer, and the gradient rows); paired: median over "
          "rounds of the ratio within a round)")
    return results


def _pipeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import pipeline

    results: list[dict[str, Any]] = []
    for world in args.world_sizes:
        for m in args.microbatches:
            results += _run(args, f"{world} stages, {m} microbatches", pipeline.run_rank,
                            world, m, args.rounds)[0]
    stages = {case: f"{v}/{torch_v}" for case, _, v, _, torch_v in pipeline.CASES}
    print(format_table(
        ["schedule", "V tp/torch", "ranks", "microbatches", "tensorpar ms", "torch ms",
         "paired tp/torch", "compute ms", "bubble", "torch bubble", "theory",
         "bubble - theory", "idle", "torch idle"],
        [[r["case"], stages[r["case"]], r["ranks"], r["microbatches"], _ms(r["tensorpar"]),
          _ms(r["torch"]),
          _x(r["paired_ratio"]), _ms(r["compute"]), f"{r['bubble']:.3f}",
          f"{r['torch_bubble']:.3f}", f"{r['bubble_theory']:.3f}",
          f"{r['bubble'] - r['bubble_theory']:+.3f}", f"{r['idle']:.3f}",
          f"{r['torch_idle']:.3f}"] for r in results]))
    print("(one training step of an nn.Sequential of Linear+GELU blocks, float32, sizes in "
          "tensorpar.bench.workloads.pipeline.SHAPE; torch: torch.distributed.pipelining's "
          "ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B (2 virtual stages) / "
          "ScheduleInterleavedZeroBubble (2 virtual stages; beside tensorpar's zero-bubble "
          "with 1 and with 2: torch has no zero-bubble schedule of one stage per rank, so "
          "the zero-bubble row with V 1/2 is not like for like, zero-bubble-interleaved is) "
          "on the same blocks; V: stages per rank; "
          "step: the slowest rank's, median over rounds; paired: median over rounds of the "
          "ratio within a round; compute: a rank's forwards and backwards of the same "
          "microbatches alone (no communication), slowest rank; bubble: 1 - compute / step "
          "of the rank with the most compute, in the same round, median over rounds "
          "(tensorpar's step, and torch's, both against tensorpar's compute of its V); "
          "theory: (P - 1) / (V m + P - 1) (zero-bubble: "
          "(P - 1) / (3 V m + P - 1)), for equal stages; idle: 1 - compute / step per rank, "
          "mean over ranks (adds the faster stages' waits for the slower))")
    return results


def _domain(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Domain parallelism (`tensorpar.bench.workloads.domain`): strips against the ideal."""
    from tensorpar.bench.workloads import domain

    results = [_run(args, f"{world} ranks, {name}", domain.run_rank, world, name, args.size,
                    args.rounds)[0]
               for name in domain.WORKLOADS for world in args.world_sizes]
    rows = []
    for r in results:
        mib = 2**20
        exact = r["exact_bytes"]
        rows.append([r["workload"], r["world_size"], f"{r['size']}x{r['size']}",
                     _ms(r["domain"]), _ms(r["ideal"]), _x(r["domain/ideal"]),
                     _x(r["floor/ideal"]) if "floor" in r else "-",
                     _x(r["domain/floor"]) if "floor" in r else "-",
                     f"{max(r['halo_bytes']) / mib:.2f}",
                     "-" if exact is None else
                     ("yes" if exact == r["halo_bytes"] else f"no ({max(exact) / mib:.2f})"),
                     f"{max(r['saved_bytes']) / mib:.1f}", f"{r['saved_dense'] / mib:.1f}",
                     _x(max(r["saved_bytes"]) / r["saved_dense"])])
    print(format_table(["workload", "ranks", "image", "domain ms", "ideal ms",
                        "paired domain/ideal", "floor/ideal", "domain/floor",
                        "halo MiB/step (max rank)", "= exact count",
                        "saved MiB (max rank)", "saved MiB dense", "saved/dense"], rows))
    print("(float32, batch 1, forward+backward, strips along H, one thread per rank; ideal: "
          "the dense model on the rank's rows plus the first layer's halo rows, no "
          "communication; floor: the ideal plus one exchange of a few numbers per norm each "
          f"way, what exact norms cannot avoid; {os.cpu_count()} CPU cores)")
    st = [[r["workload"], r["world_size"], _ms(r["domain_fwd"]), _ms(r["shardtensor_fwd"]),
           _ms(r["ideal_fwd"]), _x(r["domain_fwd/ideal_fwd"]),
           _x(r["shardtensor_fwd/ideal_fwd"]), _x(r["shardtensor_fwd/domain_fwd"]),
           r["shardtensor_step"]] if "domain_fwd" in r else
          [r["workload"], r["world_size"], *["-"] * 6, r["shardtensor_step"]]
          for r in results]
    if any("domain_fwd" in r for r in results):
        print(format_table(["workload", "ranks", "domain fwd ms", "ShardTensor fwd ms",
                            "ideal fwd ms", "domain/ideal", "ShardTensor/ideal",
                            "ShardTensor/domain", "ShardTensor step"], st))
        print("(forward only, no_grad: PhysicsNeMo's ShardTensor on the same model and strips)")
    else:
        print("PhysicsNeMo's ShardTensor: " + results[0]["shardtensor_step"])
    return results


def _hierarchical(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import hierarchical

    return hierarchical.suite(args)


def _context(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench.workloads import context

    rows: list[dict[str, Any]] = []
    for world in args.world_sizes:
        for total in args.lengths:
            rows += _run(args, f"{world} ranks, T={total}", context.run_rank, world, total,
                         args.rounds)[0]
    print(format_table(
        ["case", "ranks", "T", "ring ms", "compute ms", "comm ms", "limit ms",
         "paired ring/limit", "paired ring/compute", "ulysses ms", "paired ulysses/ring",
         "saved MiB/rank", "saved x W / dense"],
        [[r["case"], r["world_size"], r["total"], _ms(r["ring"]), _ms(r["compute"]),
          _ms(r["comm"]), _ms(r["limit"]), _x(r["ring/limit"]), _x(r["ring/compute"]),
          _ms(r.get("ulysses")), _x(r.get("ulysses/ring")), f"{r['saved'] / 2**20:.2f}",
          f"{r['saved'] * r['world_size'] / r['dense_saved']:.2f}"] for r in rows]))
    notes = sorted({r["torch_cp"] for r in rows if "torch_cp" in r})
    print(f"(forward+backward, float32, causal, zigzag layout; sizes in "
          f"tensorpar.bench.workloads.context LAYER and LLAMA; every case once per round, "
          f"in the same rounds; compute: this rank's share of the arithmetic, locally (SDPA, "
          f"the diagonal blocks with is_causal; the Llama: the same model step with that "
          f"attention); comm: the ring's transfers alone; limit: max(compute, comm) of the "
          f"round, as the ring overlaps the two; paired: median over rounds of the ratio "
          f"within a round; saved: bytes autograd keeps per rank, parameters excluded. "
          f"torch's experimental context_parallel is not measured: this suite runs on CPU "
          f"with gloo, and there it gives: {'; '.join(notes) or '-'})")
    return rows


SUITES = {"scatter-gather": _scatter_gather, "collectives": _collectives, "reducer": _reducer,
          "layers": _layers, "hierarchical": _hierarchical, "moe": _moe,
          "regather": _regather, "pipeline": _pipeline, "domain": _domain, "context": _context}
DEFAULTS: dict[str, dict[str, Any]] = {  # for options left out
    "scatter-gather": {"world_sizes": [2], "mib": [64.0], "rounds": 15},
    "collectives": {"world_sizes": [2, 4], "mib": [1.0, 64.0], "rounds": 15, "budget": 1.5},
    "reducer": {"world_sizes": [2, 4], "models": ["8M", "30M"], "rounds": 11,
                "timeout": 900.0},
    "layers": {"world_sizes": [2, 4], "rounds": 31, "compile": "inductor"},
    "moe": {"world_sizes": [2, 4], "rounds": 15},
    "regather": {"world_sizes": [2, 4], "rounds": 31},
    "pipeline": {"world_sizes": [2, 4], "microbatches": [4, 8], "rounds": 9},
    "domain": {"world_sizes": [2, 4], "rounds": 5, "size": 512},
    "context": {"world_sizes": [2, 4], "lengths": [2048, 4096, 8192], "rounds": 5},
    "hierarchical": {"mib": [4.0, 64.0, 256.0], "rounds": 3, "link": "500mbit",
                     "slice_mib": 4.0, "timeout": 900.0, "skip_reducer": False,
                     "reducer_rounds": 7},
}
