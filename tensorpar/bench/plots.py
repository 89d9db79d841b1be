"""PNG plots of a ``python -m tensorpar.bench all`` report (matplotlib, imported lazily).

- ``collectives.png``: tensorpar / raw time against payload size (paired, where the run
  has paired ratios), one line per collective, one panel per world size, with the run's
  noise (raw again / raw, paired alike) in grey;
- ``reducer.png``: one training iteration per variant (tensorpar, DDP, the baselines);
- ``layers.png``: tensorpar, DTensor, the dense process and the floor, per workload (the
  sequence-parallel Llama: tensorpar with and without sequence parallelism, DTensor's);
- ``scatter_gather.png`` and ``hierarchical.png`` where those suites ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorpar.bench.summary import COLLECTIVE_ORDER

__all__ = ["plot_report", "require_matplotlib"]

_MISSING = ("plotting needs matplotlib, which is not installed; install the bench extra "
            "(pip install 'tensorpar[bench]') or matplotlib itself")


def require_matplotlib() -> None:
    """Raise ``SystemExit`` with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(_MISSING) from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")


def _collectives(plt: Any, rows: list[dict[str, Any]], title: str) -> Any:
    rows = [r for r in rows if r["table"] == "collectives"]
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.2), squeeze=False,
                             sharey=True)
    # the paired ratios where the run has them (see `workloads._timing.paired_ratio`)
    paired = all("paired_ratio" in r for r in rows)
    ratio, spread = ("paired_ratio", "paired_noise") if paired else ("ratio", "noise")
    for ax, world in zip(axes[0], worlds, strict=True):
        for name in COLLECTIVE_ORDER:
            pts = sorted((r["nbytes"] / 2**20, r[ratio]) for r in rows
                         if r["collective"] == name and r["world_size"] == world)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        noise = sorted((r["nbytes"] / 2**20, r[spread]) for r in rows
                       if r["world_size"] == world and r[spread] is not None)
        if noise:
            ax.scatter(*zip(*noise, strict=True), color="grey", marker="x", alpha=0.6,
                       label="raw again / raw (noise)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload per rank (MiB)")
        ax.set_title(f"{world} ranks")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tensorpar / raw time" + (" (paired)" if paired else ""))
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(title)
    return fig


def _reducer(plt: Any, rows: list[dict[str, Any]], title: str) -> Any:
    rows = [r for r in rows if r.get("table") == "time"]
    variants = {"tensorpar": "tensorpar", "ddp": "DDP", "per_param": "per-param all-reduce",
                "flatten_at_end": "flatten at end", "no_comm": "no communication"}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    _bars(ax, [f"{r['world_size']} ranks, {r['model']}" for r in rows],
          {label: [r[key] * 1e3 for r in rows] for key, label in variants.items()},
          "ms per iteration")
    ax.set_title(title)
    return fig


def _layers(plt: Any, rows: list[dict[str, Any]], title: str) -> Any:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4.2),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        keys = (("floor", "tensorpar_sp", "tensorpar_tp", "dtensor_sp")
                if mine[0].get("table") == "sequence" else ("dense", "floor", "tensorpar",
                                                              "dtensor"))
        _bars(ax, [f"tp {r['tp']}" for r in mine], {k: [r[k] * 1e3 for r in mine] for k in keys},
              "ms per forward + backward")
        ax.set_title(workload)
    fig.suptitle(title)
    return fig


def _scatter_gather(plt: Any, rows: list[dict[str, Any]], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _bars(ax, [f"{r['world_size']} ranks, {r['nbytes'] / 2**20:g} MiB" for r in rows],
          {k: [r[k] * 1e3 for r in rows] for k in ("raw", "raw_alloc", "tensorpar",
                                                    "tensorpar_known_meta")},
          "ms per scatter + gather")
    ax.set_title(title)
    return fig


def _hierarchical(plt: Any, rows: list[dict[str, Any]], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = [r for r in rows if "mib" in r]  # the all-reduce rows, not the reducer's
    for key in ("flat", "hierarchical", "hierarchical_one_slice"):
        ax.plot([r["mib"] for r in rows], [r[key] * 1e3 for r in rows], marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (MiB)")
    ax.set_ylabel("ms per all-reduce")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    return fig


_PLOTS = {"collectives": (_collectives, "collectives: tensorpar vs raw torch.distributed"),
          "reducer": (_reducer, "reducer: one training iteration"),
          "layers": (_layers, "tensor-parallel layers: tensorpar vs DTensor vs floor"),
          "scatter-gather": (_scatter_gather, "scatter + gather from rank 0"),
          "hierarchical": (_hierarchical, "hierarchical vs flat all-reduce")}


def plot_report(report: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write one PNG per suite with results in ``report`` into ``directory``.

    Args:
        report: what `tensorpar.bench.report.run_all` returned (or its JSON, loaded).
        directory: where the files go (created if missing).

    Returns:
        The paths written.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    plt = _pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    stamp = f"{report.get('date', '')}, {report.get('machine', {}).get('cores', '?')} cores, gloo"
    for name, (make, title) in _PLOTS.items():
        suite = report.get("suites", {}).get(name)
        if not suite or not suite["results"]:
            continue
        fig = make(plt, suite["results"], title)
        fig.text(0.99, 0.01, stamp, ha="right", va="bottom", fontsize="x-small", color="grey")
        fig.tight_layout()
        path = out / f"{name.replace('-', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
