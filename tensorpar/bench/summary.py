"""The headline tables of a ``python -m tensorpar.bench all`` report.

One or two tables per suite that ran, shorter than the suite's own printout: the figures a
reader compares first. The same rows feed the terminal (``rich``) and the markdown for the docs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COLLECTIVE_ORDER", "summary_tables"]

Table = tuple[str, list[str], list[list[str]], str]
"""(title, header, rows, a note saying what the figures are)."""

COLLECTIVE_ORDER = ("all_gather", "all_gather (exchange sizes)", "reduce_scatter",
                    "all_reduce", "all_reduce (in place)", "all_to_all")
"""The ``collective`` values of the collectives suite's rows, in the order they are shown."""


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def _scatter_gather(rows: list[dict[str, Any]]) -> list[Table]:
    return [("scatter + gather", ["ranks", "size", "raw ms", "raw+alloc ms", "tensorpar ms",
                                 "known-meta ms", "paired tensorpar / raw+alloc"],
            [[str(r["world_size"]), _size(r["nbytes"]), _ms(r["raw"]), _ms(r["raw_alloc"]),
              _ms(r["tensorpar"]), _ms(r["tensorpar_known_meta"]),
              _x(r.get("tensorpar/raw_alloc"))] for r in rows],
            "Rank 0 scatters a float32 tensor and gathers it back; median of the slowest "
            "rank. raw+alloc: `dist.scatter` + `dist.gather` allocating their outputs; "
            "paired: the median over rounds of the two calls' ratio within one round.")]


def _in_order(rows: list[dict[str, Any]], table: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["table"] == table),
                  key=lambda r: (COLLECTIVE_ORDER.index(r["collective"]), r["world_size"],
                                 r["nbytes"]))


def _collectives(rows: list[dict[str, Any]]) -> list[Table]:
    tables: list[Table] = [(
        "collectives", ["collective", "ranks", "size", "raw ms", "tensorpar ms",
                        "tensorpar / raw", "raw again / raw", "paired tensorpar / raw",
                        "paired raw again / raw"],
        [[r["collective"], str(r["world_size"]), _size(r["nbytes"]), _ms(r["raw"]),
          _ms(r["tensorpar"]), _x(r["ratio"]), _x(r["noise"]), _x(r.get("paired_ratio")),
          _x(r.get("paired_noise"))]
         for r in _in_order(rows, "collectives")],
        "Median per call, back to back, slowest rank. raw: the `torch.distributed` call "
        "allocating its output; raw again / raw: the raw call timed a second time, the "
        "noise of the run; paired: the median over turns of the two calls' ratio within "
        "one turn.")]
    checked = _in_order(rows, "validation")
    if checked:
        tables.append((
            "validation mode", ["collective", "ranks", "size", "off ms", "on ms", "on / off",
                                "paired on / off", "loop on / off"],
            [[r["collective"], str(r["world_size"]), _size(r["nbytes"]), _ms(r["off"]),
              _ms(r["on"]), _x(r["ratio"]), _x(r.get("paired_ratio")),
              _x(r.get("loop_ratio"))] for r in checked],
            "tensorpar's call with validation mode off and on, call by call as above; loop: "
            "over blocks of up to 20 calls in a row. On adds one small exchange of a "
            "fingerprint before every call."))
    return tables


def _reducer(rows: list[dict[str, Any]]) -> list[Table]:
    timed = [r for r in rows if r.get("table") == "time"]
    return [("reducer: one training iteration",
             ["ranks", "model", "no comm ms", "tensorpar ms", "DDP ms", "paired tensorpar / DDP",
              "default buckets ms", "paired default / DDP", "exposed tensorpar ms",
              "exposed DDP ms"],
             [[str(r["world_size"]), r["model"], _ms(r["no_comm"]), _ms(r["tensorpar"]),
               _ms(r["ddp"]), _x(r["tp_over_ddp"]), _ms(r.get("tensorpar_default")),
               _x(r.get("tp_default_over_ddp")), _ms(r["exposed_tensorpar"]),
               _ms(r["exposed_ddp"])] for r in timed],
             "Forward + backward + gradient averaging of an 8-layer MLP, `BucketedAllReduce` "
             "and DDP with 25 MiB buckets (gradients as bucket views in both), and "
             "`BucketedAllReduce` with its default bucket size; paired: the median over "
             "rounds of the two iterations' ratio within one round; exposed: the iteration "
             "minus the no-communication time.")]


def _layers(rows: list[dict[str, Any]]) -> list[Table]:
    sequence = [r for r in rows if r.get("table") == "sequence"]
    rows = [r for r in rows if r.get("table") != "sequence"]
    tables = _sequence(sequence) if sequence else []
    return [("tensor-parallel layers", ["workload", "tp", "dense ms", "floor ms",
                                       "tensorpar ms", "DTensor ms", "tensorpar / DTensor",
                                       "tensorpar / floor", "paired tensorpar / floor",
                                       "paired floor again / floor"],
            [[r["workload"], str(r["tp"]), _ms(r["dense"]), _ms(r["floor"]),
              _ms(r["tensorpar"]), _ms(r["dtensor"]), _x(r["tensorpar"] / r["dtensor"]),
              _x(r["tensorpar"] / r["floor"]), _x(r.get("tensorpar/floor")),
              _x(r.get("floor_again/floor"))] for r in rows],
            "Forward + backward per step. dense: one process computing everything; floor: "
            "this rank's share of the dense compute plus the raw all-reduces of the same bytes; "
            "paired: the median over rounds of the two steps' ratio within one round."),
            *tables]


def _sequence(rows: list[dict[str, Any]]) -> list[Table]:
    return [("sequence parallelism (Llama)",
             ["tp", "floor ms", "tensorpar SP ms", "tensorpar TP ms", "DTensor SP ms",
              "paired tensorpar SP / DTensor SP", "paired tensorpar SP / floor",
              "paired tensorpar SP / tensorpar TP", "paired floor again / floor"],
             [[str(r["tp"]), _ms(r["floor"]), _ms(r["tensorpar_sp"]), _ms(r["tensorpar_tp"]),
               _ms(r["dtensor_sp"]), _x(r.get("tensorpar_sp/dtensor_sp")),
               _x(r.get("tensorpar_sp/floor")), _x(r.get("tensorpar_sp/tensorpar_tp")),
               _x(r.get("floor_again/floor"))] for r in rows],
             "A transformers LlamaModel, forward + backward per step. SP: sequence parallelism "
             "(DTensor: `SequenceParallel` norms); TP: tensorpar without it; floor: this "
             "rank's share of the compute plus the raw all-gathers, reduce-scatters and "
             "all-reduces of the same bytes.")]


def _hierarchical(rows: list[dict[str, Any]]) -> list[Table]:
    tables: list[Table] = [(
        "hierarchical all-reduce (simulated cluster)",
        ["size", "flat ms", "hierarchical ms", "hierarchical / flat", "one slice ms"],
        [[f"{r['mib']:g} MiB", _ms(r["flat"]), _ms(r["hierarchical"]),
          _x(r["hierarchical"] / r["flat"]), _ms(r["hierarchical_one_slice"])]
         for r in rows if "mib" in r],
        "Two simulated machines with rate-limited links; median of the slowest rank.")]
    for r in rows:
        if r.get("table") == "reducer":
            variants = ("tensorpar", "tensorpar_hierarchical", "ddp", "no_comm",
                        "raw_all_reduce", "raw_hierarchical")
            tables.append((
                "the reducer end to end on the simulated cluster",
                ["variant", "ms / iteration", "/ limit", "/ tensorpar (flat)"],
                [[v, _ms(r.get(v)), _x(r.get(f"{v}_over_limit")),
                  _x(r[v] / r["tensorpar"] if v in r and "tensorpar" in r else None)]
                 for v in variants],
                "`BucketedAllReduce` with the flat and the hierarchical algorithm beside DDP, "
                "2 machines x 2 ranks; limit: the slower of the step without communication "
                "and the fastest raw all-reduce of all gradients."))
    return tables


_TABLES = {"scatter-gather": _scatter_gather, "collectives": _collectives,
           "layers": _layers, "reducer": _reducer, "hierarchical": _hierarchical}


def summary_tables(report: dict[str, Any]) -> list[Table]:
    """The headline tables (one or two per suite) of the suites in ``report`` with results.

    Args:
        report: what `tensorpar.bench.report.run_all` returned (or its JSON, loaded).

    Returns:
        ``(title, header, rows, note)`` per table, rows as strings.
    """
    tables = []
    for name, make in _TABLES.items():
        suite = report.get("suites", {}).get(name)
        if suite and suite["results"]:
            tables += make(suite["results"])
    return tables
