"""Command line: ``python -m tensorpar.bench SUITE [--world-sizes 2 4] [--json PATH]``."""

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


SUITES = {"scatter-gather": _scatter_gather}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorpar.bench", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--mib", type=float, nargs="+", default=[64.0],
                        help="payload sizes in MiB")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    results = SUITES[args.suite](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
