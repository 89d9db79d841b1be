"""Command line: ``python -m tensorpar.bench SUITE [--world-sizes 2 4] [--json PATH]``.

Suites: ``scatter-gather``, ``collectives``, ``reducer``, ``layers``, ``moe``, ``regather``
(sequence parallelism's backward all-gather overlapped or not), ``pipeline`` (schedules
against torch.distributed.pipelining), ``domain`` (domain parallelism against the
ideal), ``context`` (ring attention and context_parallel against their ideal), ``hierarchical`` (a
simulated 2-machine cluster; needs root). Options left out take the suite's
defaults. ``python -m tensorpar.bench all [--quick] [--json PATH] [--plot DIR]`` runs every
suite with a progress display and writes plots (see `tensorpar.bench.report`).
``python -m tensorpar.bench layers --profile`` also prints the top functions of a step.
"""

from __future__ import annotations

import argparse
import json
import sys

from tensorpar.bench.suites import DEFAULTS, SUITES


def main(argv: list[str] | None = None) -> int:
    """Run one suite (or ``all``) from the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["all"]:
        from tensorpar.bench import report

        return report.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tensorpar.bench", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES),
                        help="one suite; or 'all' (see python -m tensorpar.bench all --help)")
    parser.add_argument("--world-sizes", type=int, nargs="+",
                        help="default: 2 (scatter-gather), 2 4 (collectives, reducer, layers: "
                             "the tensor-parallel size)")
    parser.add_argument("--mib", type=float, nargs="+",
                        help="payload sizes in MiB; default: 64 (scatter-gather), 1 64 "
                             "(collectives)")
    parser.add_argument("--models", nargs="+", choices=["8M", "30M"],
                        help="reducer: models to train; default: 8M 30M")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="context: sequence lengths; default: 2048 4096 8192")
    parser.add_argument("--rounds", type=int,
                        help="timed rounds per case; default: 15 (reducer: 11, layers: 31)")
    parser.add_argument("--microbatches", type=int, nargs="+",
                        help="pipeline: microbatches per step; default: 4 8")
    parser.add_argument("--budget", type=float,
                        help="collectives: seconds of raw calls that set each case's number "
                             "of calls; default: 1.5")
    parser.add_argument("--timeout", type=float,
                        help="seconds per run_distributed call; default: 600 (reducer: 900)")
    parser.add_argument("--link", help="hierarchical, reducer --cluster: each simulated "
                                       "machine's link rate (tc notation); default: 500mbit "
                                       "(hierarchical), 1gbit (reducer)")
    parser.add_argument("--cluster", metavar="MxR",
                        help="reducer: run on a simulated cluster of M machines x R ranks "
                             "(e.g. 2x1; needs root) instead of loopback")
    parser.add_argument("--batch", type=int,
                        help="reducer --cluster: rows per rank (default 128: communication-"
                             "bound at 1gbit; about 640 balances compute and communication)")
    parser.add_argument("--slice-mib", type=float,
                        help="hierarchical: pipeline slice size in MiB; default: 4")
    parser.add_argument("--skip-reducer", action="store_true", default=None,
                        help="hierarchical: time the all-reduce only, not the reducer end to "
                             "end on the same cluster")
    parser.add_argument("--reducer-rounds", type=int,
                        help="hierarchical: timed rounds of the reducer end to end; default: 7")
    parser.add_argument("--profile", type=int, nargs="?", const=15, metavar="TOP",
                        help="layers: also profile tensorpar's step and the floor's and print "
                             "the TOP functions per step (default 15)")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="layers: also time tensorpar and DTensor under torch.compile with "
                             "this backend; default: inductor ('' to skip)")
    parser.add_argument("--size", type=int,
                        help="domain: the image's height and width; default: 512")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name, value in {"timeout": 600.0, **DEFAULTS[args.suite]}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    results = SUITES[args.suite](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": args.suite, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
