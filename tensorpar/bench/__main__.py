"""Command line: ``python -m tensorpar.bench SUITE [--world-sizes 2 4] [--json PATH]``.

Suites: ``scatter-gather``, ``collectives``. Options left out take the suite's defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tensorpar.bench._timing import format_table
from tensorpar.testing import run_distributed


def _scatter_gather(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench import scatter_gather

    results = []
    for world in args.world_sizes:
        for mib in args.mib:
            per_rank = run_distributed(scatter_gather.run_rank, world, int(mib * 2**20),
                                       args.rounds, timeout=args.timeout)
            results.append(per_rank[0])
    rows = [[r["world_size"], f"{r['nbytes'] / 2**20:g} MiB",
             *(f"{r[k] * 1e3:.2f}" for k in ("raw", "raw_alloc", "tensorpar",
                                               "tensorpar_known_meta")),
             *(f"{r[a] / r[b]:.2f}" for a, b in (("tensorpar", "raw"), ("tensorpar", "raw_alloc"),
                                                 ("tensorpar_known_meta", "raw_alloc")))]
            for r in results]
    print(format_table(["ranks", "size", "raw ms", "raw+alloc ms", "tensorpar ms",
                        "known-meta ms", "tp/raw", "tp/raw+alloc", "known-meta/raw+alloc"],
                       rows))
    return results


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _collectives(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensorpar.bench import collectives

    results: list[dict[str, Any]] = []
    for world in args.world_sizes:
        for mib in args.mib:
            results += run_distributed(collectives.run_rank, world, int(mib * 2**20),
                                       args.rounds, timeout=args.timeout)[0]
    order = ["all_gather", "all_gather (exchange sizes)", "reduce_scatter", "all_reduce",
             "all_reduce (in place)", "all_to_all"]
    rows = sorted((r for r in results if r["table"] == "collectives"),
                  key=lambda r: (order.index(r["collective"]), r["world_size"], r["nbytes"]))
    print(format_table(
        ["collective", "ranks", "size", "raw ms", "raw prealloc ms", "tensorpar ms",
         "tp/raw", "tp/raw prealloc"],
        [[r["collective"], r["world_size"], f"{r['nbytes'] / 2**20:.3g} MiB", _ms(r["raw"]),
          _ms(r["raw_prealloc"]), _ms(r["tensorpar"]), _x(r["ratio"]),
          _x(r["ratio_prealloc"])] for r in rows]))
    print()
    uneven = [r for r in results if r["table"] == "uneven_all_to_all"]
    print(format_table(
        ["uneven all_to_all splits", "ranks", "size", "padded bytes", "tensorpar ms", "padded ms",
         "p2p ms", "padded/tp", "p2p/tp"],
        [[":".join(str(s) for s in r["splits"]), r["world_size"],
          f"{r['nbytes'] / 2**20:.3g} MiB", f"x{r['padded_nbytes'] / r['nbytes']:.2f}",
          _ms(r["tensorpar"]), _ms(r["padded"]), _ms(r["p2p"]), _x(r["padded_ratio"]),
          _x(r["p2p_ratio"])] for r in uneven]))
    return results


SUITES = {"scatter-gather": _scatter_gather, "collectives": _collectives}
DEFAULTS: dict[str, dict[str, Any]] = {  # for options left out
    "scatter-gather": {"world_sizes": [2], "mib": [64.0]},
    "collectives": {"world_sizes": [2, 4], "mib": [1.0, 64.0]},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorpar.bench", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--world-sizes", type=int, nargs="+",
                        help="default: 2 (scatter-gather), 2 4 (collectives)")
    parser.add_argument("--mib", type=float, nargs="+",
                        help="payload sizes in MiB; default: 64 (scatter-gather), 1 64 "
                             "(collectives)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per case")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.suite].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    results = SUITES[args.suite](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
