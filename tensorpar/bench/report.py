"""``python -m tensorpar.bench all``: every suite in one run, with progress, JSON and plots.

Runs the suites of ``python -m tensorpar.bench`` one after another with the settings of a full
run (each suite's defaults) or, with ``--quick``, small sizes and few rounds for a smoke run.
A live display (``rich``) shows the suite and case under way and the time spent; the suites'
own tables print above it as each suite ends. What each suite measures, and how (interleaved
cases, the slowest rank's time, medians: `tensorpar.bench.workloads._timing`), is unchanged.

Outputs:

- ``--json PATH``: the machine, the date, the settings and every suite's figures, rewritten
  after each suite so an interrupted run keeps what it measured;
- ``--plot DIR``: PNG plots (see `tensorpar.bench.plots`);
- ``--markdown PATH``: the summary tables as markdown, for a docs page.

``rich`` and ``matplotlib`` come with the ``bench`` extra (``pip install tensorpar[bench]``).
Without ``rich`` the progress is printed as plain lines; ``--plot`` without ``matplotlib``
stops before running anything, with a message saying what to install.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tensorpar.bench.summary import summary_tables
from tensorpar.bench.workloads._timing import format_table

__all__ = ["QUICK", "machine", "main", "planned_cases", "run_all", "unavailable"]

QUICK: dict[str, dict[str, Any]] = {
    "scatter-gather": {"world_sizes": [2], "mib": [0.25, 4.0], "rounds": 3},
    "collectives": {"world_sizes": [2], "mib": [0.0625, 1.0, 4.0], "rounds": 5, "budget": 0.1},
    "reducer": {"world_sizes": [2], "models": ["8M"], "rounds": 3},
    "layers": {"world_sizes": [2], "rounds": 3},
    "hierarchical": {"mib": [1.0, 4.0], "rounds": 2, "link": "500mbit", "slice_mib": 1.0,
                     "timeout": 600.0, "skip_reducer": True},
}
"""Settings of ``all --quick``: one small world size, small payloads, few rounds."""

ORDER = ("scatter-gather", "collectives", "layers", "reducer", "hierarchical")
"""The order ``all`` runs the suites in: the quick ones first."""


def planned_cases(suite: str, settings: dict[str, Any]) -> int:
    """How many rank-pool calls (progress steps) ``suite`` makes with ``settings``.

    Args:
        suite: a suite name, as on the command line.
        settings: the suite's options (``world_sizes``, ``mib``, ``models``, ...).

    Returns:
        The number of cases the progress display counts for the suite.
    """
    worlds = len(settings.get("world_sizes", [1]))
    if suite in ("scatter-gather", "collectives"):
        return worlds * len(settings["mib"])
    if suite == "reducer":
        from tensorpar.bench.workloads.reducer import MEMORY_VARIANTS

        return worlds * len(settings["models"]) * (1 + len(MEMORY_VARIANTS))
    if suite == "layers":
        from tensorpar.bench.workloads.layers import WORKLOADS

        return worlds * (len(WORKLOADS) + 1)  # + the sequence-parallel row
    return 1  # hierarchical: one cluster job


def unavailable(suite: str) -> str | None:
    """Why ``suite`` cannot run on this machine, or ``None`` if it can.

    Args:
        suite: a suite name, as on the command line.

    Returns:
        A reason to print, or ``None``.
    """
    if suite != "hierarchical":
        return None
    try:
        from tensorpar.bench.workloads import hierarchical  # noqa: F401
        from tensorpar.testing import _netns

        _netns.check_privileges(need_tc=True)
    except Exception as exc:  # a missing module, not root, no ip/tc: all mean "skip"
        return f"{type(exc).__name__}: {exc}"
    return None


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, core count, OS, Python, torch and backend.

    Returns:
        A JSON-ready dict.
    """
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(terse=True),
            "python": platform.python_version(), "torch": torch.__version__,
            "backend": "gloo", "device": "cpu"}


class _Progress:
    """The live display: one bar for the whole run, one for the suite under way."""

    def __init__(self, total: int) -> None:
        self._stack = contextlib.ExitStack()
        self._total, self._done = total, 0
        self._rich: Any = None
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        self._rich = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn())
        self._all = self._rich.add_task("all suites", total=total)
        self._suite = self._rich.add_task("", total=1, visible=False)

    def __enter__(self) -> _Progress:
        if self._rich is not None:
            self._stack.enter_context(self._rich)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def done(self) -> int:
        """Cases counted so far."""
        return self._done

    def suite(self, name: str, cases: int) -> None:
        """Start counting the cases of suite ``name``."""
        self._name = name
        if self._rich is not None:
            self._rich.reset(self._suite, total=cases, description=name, visible=True)

    @contextlib.contextmanager
    def case(self, label: str) -> Iterator[None]:
        """Show ``label`` while one case runs; count it when it ends."""
        if self._rich is not None:
            self._rich.update(self._suite, description=f"{self._name}: {label}")
        else:
            print(f"[{self._done + 1}/{self._total}] {self._name}: {label}", flush=True)
        yield
        self._done += 1
        if self._rich is not None:
            self._rich.advance(self._suite)
            self._rich.advance(self._all)

    def skip(self, cases: int) -> None:
        """Count ``cases`` that will not run (a failed suite's rest)."""
        self._done += cases
        if self._rich is not None:
            self._rich.advance(self._all, cases)


def run_all(suites: list[str], settings: dict[str, dict[str, Any]],
            on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``suites`` in turn with ``settings`` and collect their figures.

    A suite that raises is recorded under ``failed`` and the next one runs.

    Args:
        suites: suite names, in the order to run them.
        settings: each suite's options, as its command line would set them.
        on_update: called with the report so far after each suite (to save it).

    Returns:
        The report: ``machine``, ``date``, ``settings``, ``suites`` (name -> ``results`` and
        ``seconds``), ``skipped`` and ``failed`` (name -> reason).
    """
    from tensorpar.bench.suites import SUITES

    report: dict[str, Any] = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {s: settings[s] for s in suites}, "suites": {}, "skipped": {},
        "failed": {}}
    runnable = []
    for name in suites:
        reason = unavailable(name)
        if reason is None:
            runnable.append(name)
        else:
            report["skipped"][name] = reason
            print(f"skipping {name}: {reason}", flush=True)
    counts = {name: planned_cases(name, settings[name]) for name in runnable}
    with _Progress(sum(counts.values())) as progress:
        for name in runnable:
            progress.suite(name, counts[name])
            before = progress.done
            args = argparse.Namespace(**settings[name], on_case=progress.case)
            start = time.perf_counter()
            try:
                results = SUITES[name](args)
            except Exception as exc:
                report["failed"][name] = f"{type(exc).__name__}: {exc}"
                print(f"{name} failed: {report['failed'][name]}", flush=True)
                progress.skip(counts[name] - (progress.done - before))
            else:
                report["suites"][name] = {"seconds": time.perf_counter() - start,
                                          "results": results}
            if on_update is not None:
                on_update(report)
    return report


def _print_summary(report: dict[str, Any]) -> None:
    """The summary tables on the terminal (``rich`` tables where available)."""
    tables = summary_tables(report)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, header, rows, _ in tables:
            print(f"\n{title}\n{format_table(header, rows)}")
        return
    console = Console()
    for title, header, rows, _ in tables:
        table = Table(*header, title=title)
        for row in rows:
            table.add_row(*(str(c) for c in row))
        console.print(table)


def markdown(report: dict[str, Any]) -> str:
    """The summary tables of ``report`` as markdown sections (for the docs page).

    Args:
        report: what `run_all` returned (or its JSON, loaded).

    Returns:
        Markdown text: a heading, a note and a table per summary.
    """
    parts = []
    for title, header, rows, note in summary_tables(report):
        parts.append(f"### {title}\n\n{format_table(header, rows)}\n\n{note}\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorpar.bench all [options]``; returns the exit status.

    Args:
        argv: the arguments after ``all``.

    Returns:
        0 when every suite that could run succeeded, else 1.
    """
    from tensorpar.bench.suites import DEFAULTS

    parser = argparse.ArgumentParser(prog="python -m tensorpar.bench all",
                                     description="Run every benchmark suite.")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few rounds: a smoke run of a few minutes")
    parser.add_argument("--suites", nargs="+", choices=ORDER, default=list(ORDER),
                        help="run only these suites (default: all; hierarchical is skipped "
                             "with a reason where it cannot run)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--markdown", metavar="PATH", help="write the summary tables as markdown")
    parser.add_argument("--from-json", metavar="PATH",
                        help="run nothing: make the plots and tables of a saved JSON")
    args = parser.parse_args(argv)
    if args.plot:
        from tensorpar.bench.plots import require_matplotlib

        require_matplotlib()  # fail before a long run, not after it
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        base = QUICK if args.quick else DEFAULTS
        settings = {name: {"timeout": 600.0, **base[name]} for name in args.suites}
        report = run_all([s for s in ORDER if s in args.suites], settings,
                         on_update=(lambda r: _write_json(r, args.json)) if args.json else None)
        report["quick"] = args.quick
        if args.json:
            _write_json(report, args.json)
    _print_summary(report)
    if args.plot:
        from tensorpar.bench.plots import plot_report

        for path in plot_report(report, args.plot):
            print(f"wrote {path}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    return 1 if report.get("failed") else 0


def _write_json(report: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
