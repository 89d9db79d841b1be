"""`python -m tensorpar.bench all`: the report, its tables and plots, and a smoke run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tensorpar.bench import report
from tensorpar.bench.summary import COLLECTIVE_ORDER, summary_tables


def _synthetic() -> dict[str, Any]:
    """A report as `run_all` returns it, with made-up figures for every suite."""
    collectives = [{"table": "collectives", "collective": c, "world_size": w,
                    "nbytes": mib * 2**20, "calls": 5, "raw": 1e-3 * mib,
                    "raw_prealloc": 0.9e-3 * mib, "tensorpar": 1.1e-3 * mib, "ratio": 1.1,
                    "ratio_prealloc": 1.2, "noise": 1.01 if "(" not in c else None,
                    "paired_ratio": 1.05, "paired_noise": 1.0 if "(" not in c else None}
                   for c in COLLECTIVE_ORDER for w in (2, 4) for mib in (0.25, 1, 4)]
    collectives.append({"table": "uneven_all_to_all", "world_size": 2, "nbytes": 2**20})
    collectives += [{"table": "validation", "collective": c, "world_size": 2, "nbytes": 2**20,
                     "off": 1e-3, "on": 1.4e-3, "ratio": 1.4, "loop_ratio": 1.3}
                    for c in ("all_reduce", "all_to_all")]
    variants = ("tensorpar", "ddp", "per_param", "flatten_at_end", "no_comm")
    reducer = [{"table": "time", "world_size": 2, "model": m, "tp_over_ddp": 0.95,
                **{v: 0.01 * (i + 1) for i, v in enumerate(variants)},
                "exposed_tensorpar": 0.002, "exposed_ddp": 0.003} for m in ("8M", "30M")]
    reducer.append({"table": "memory", "model": "8M", "variant": "ddp"})
    layers = [{"workload": w, "tp": tp, "dense": 0.01, "floor": 0.005, "tensorpar": 0.006,
               "dtensor": 0.008} for w in ("mlp-compute", "transformer") for tp in (2, 4)]
    layers += [{"table": "sequence", "workload": "llama-sp", "tp": tp, "floor": 0.02,
                "tensorpar_sp": 0.025, "tensorpar_tp": 0.024, "dtensor_sp": 0.03,
                "tensorpar_sp/dtensor_sp": 0.83, "tensorpar_sp/floor": 1.25,
                "tensorpar_sp/tensorpar_tp": 1.04, "floor_again/floor": 1.0} for tp in (2, 4)]
    scatter = [{"world_size": 2, "nbytes": 2**20, "raw": 1e-3, "raw_alloc": 1.1e-3,
                "tensorpar": 1.3e-3, "tensorpar_known_meta": 1.2e-3}]
    hier: list[dict[str, Any]] = [
        {"mib": m, "flat": 0.1 * m, "hierarchical": 0.07 * m, "hierarchical_one_slice": 0.09 * m}
        for m in (1.0, 4.0)]
    hier.append({"table": "reducer", "tensorpar": 1.0, "tensorpar_hierarchical": 0.8,
                 "tensorpar_over_limit": 1.7, "tensorpar_hierarchical_over_limit": 1.3})
    suites = {"collectives": collectives, "reducer": reducer, "layers": layers,
              "scatter-gather": scatter, "hierarchical": hier}
    return {"machine": report.machine(), "date": "2026-01-01 00:00 UTC", "settings": {},
            "suites": {k: {"seconds": 1.0, "results": v} for k, v in suites.items()},
            "skipped": {}, "failed": {}}


def test_summary_and_markdown() -> None:
    data = _synthetic()
    titles = [t[0] for t in summary_tables(data)]
    assert len(titles) == 8
    assert "validation mode" in titles and "sequence parallelism (Llama)" in titles
    assert "the reducer end to end on the simulated cluster" in titles
    text = report.markdown(data)
    assert "| all_reduce (in place) " in text and "### collectives" in text
    assert "tensorpar / DDP" in text


@pytest.mark.slow
def test_plots_from_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(_synthetic()))
    out = tmp_path / "plots"
    md = tmp_path / "tables.md"
    assert report.main(["--from-json", str(saved), "--plot", str(out),
                        "--markdown", str(md)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["collectives.png", "hierarchical.png", "layers.png", "reducer.png",
                     "scatter_gather.png"]
    assert all((out / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    assert "### collectives" in md.read_text()


def test_planned_cases() -> None:
    assert report.planned_cases("collectives", report.QUICK["collectives"]) == 3
    assert report.planned_cases("reducer", {"world_sizes": [2, 4], "models": ["8M"]}) == 6
    assert report.planned_cases("hierarchical", report.QUICK["hierarchical"]) == 1
    assert report.unavailable("layers") is None


@pytest.mark.timeout(120)
def test_all_quick_smoke(tmp_path: Path) -> None:
    """A real run of the quickest suite through ``all --quick``: JSON, plot, exit status."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.json"
    status = report.main(["--quick", "--suites", "scatter-gather", "--json", str(out),
                          "--plot", str(tmp_path)])
    assert status == 0
    saved = json.loads(out.read_text())
    rows = saved["suites"]["scatter-gather"]["results"]
    assert [r["nbytes"] for r in rows] == [int(0.25 * 2**20), 4 * 2**20]
    assert saved["quick"] is True and saved["machine"]["backend"] == "gloo"
    assert (tmp_path / "scatter_gather.png").exists()


def test_paired_ratio_cancels_drift() -> None:
    """Turn by turn the case is 5% slower, while the machine slows down 4x partway through."""
    import torch

    from tensorpar.bench.workloads._timing import paired_ratio

    speed = torch.tensor([1.0] * 4 + [4.0] * 5, dtype=torch.float64)
    baseline = speed * torch.tensor([1.0, 1.02, 0.98, 1.01, 1.0, 0.99, 1.03, 1.0, 0.97])
    samples = {"raw": baseline, "ours": baseline * 1.05,
               "ours_noisy": baseline * torch.tensor([1.05] * 8 + [3.0], dtype=torch.float64)}
    assert paired_ratio(samples, "ours", "raw") == pytest.approx(1.05)
    assert paired_ratio(samples, "raw", "raw") == 1.0
    assert paired_ratio(samples, "ours_noisy", "raw") == pytest.approx(1.05)  # one outlier


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_layers_sequence_parallel_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The layers suite's sequence-parallel row at toy sizes, one round: checks, figures, table.

    `sequence.run_rank` first checks tensorpar's (with and without sequence parallelism) and
    DTensor's loss and norm gradients against the dense model's, so the row cannot time a
    wrong computation.
    """
    import argparse

    pytest.importorskip("transformers")
    from tensorpar.bench import suites

    tiny = {"vocab": 64, "hidden": 32, "intermediate": 40, "layers": 2, "heads": 4,
            "kv_heads": 2, "head_dim": 8, "batch": 2, "seq": 8}
    args = argparse.Namespace(world_sizes=[2], rounds=1, timeout=240.0)
    rows = suites._sequence(args, tiny)
    (row,) = rows
    assert row["table"] == "sequence" and row["tp"] == 2
    for key in ("floor", "tensorpar_sp", "tensorpar_tp", "dtensor_sp", "tensorpar_sp/dtensor_sp",
                "tensorpar_sp/floor", "tensorpar_sp/tensorpar_tp", "floor_again/floor"):
        assert row[key] > 0, key
    assert row["floor_collectives"] == row["tensorpar_sp_collectives"]  # the same bytes
    suites._print_sequence(rows)
    printed = capsys.readouterr().out
    assert "| llama-sp | 2 " in printed and "paired SP/dtensor SP" in printed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regather_suite_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The regather suite at toy sizes (uneven slices), one round: figures and table.

    `regather.run_rank` first checks that the step and the layer give the same numbers, bit
    for bit, with and without the overlap.
    """
    import argparse

    pytest.importorskip("transformers")
    from tensorpar.bench import suites

    tiny = {"vocab": 64, "hidden": 48, "intermediate": 40, "layers": 2, "heads": 6,
            "kv_heads": 3, "head_dim": 8, "batch": 2, "seq": 7}
    args = argparse.Namespace(world_sizes=[3], rounds=1, timeout=240.0)
    (row,) = suites._regather(args, tiny)
    assert row["table"] == "regather" and row["tp"] == 3
    for key in ("step_overlap", "step_sync", "step_sync_again", "step_overlap/step_sync",
                "layer_overlap", "layer_sync", "layer_overlap/layer_sync_again"):
        assert row[key] > 0, key
    printed = capsys.readouterr().out
    assert "| 3  " in printed and "paired layer overlap/sync" in printed
