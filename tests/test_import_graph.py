"""The package keeps its layer order: no import circles, no arrow back up, no importlib, and
torch's private internals named in `tensorpar._torch` only (``scripts/import_graph.py``)."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"


def test_the_import_graph_has_no_circle_and_no_arrow_back_up():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "circles: 0" in done.stdout and "arrows back up (a lower layer importing a " \
        "higher one): 0" in done.stdout, done.stdout


def test_a_sub_package_importing_one_above_it_runs_back_up():
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    tiles, layers = "tensorpar.domain._tiles.agree", "tensorpar.domain._layers.pad"
    assert graph.runs_back_up(tiles, layers)
    assert not graph.runs_back_up(layers, tiles)
    assert graph.runs_back_up(tiles, "tensorpar.domain.parallelize")
    assert not graph.runs_back_up("tensorpar.domain.parallelize", "tensorpar.domain._forward.calls")
    assert graph.runs_back_up("tensorpar.comm._group", "tensorpar.domain.halo")
    assert not graph.runs_back_up("tensorpar.nn.layers.linear", "tensorpar.nn.state.checkpoint")


def test_sibling_folders_importing_each_other_are_a_circle():
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    folder = {"tensorpar.nn.layers.linear": "tensorpar/nn/layers",
              "tensorpar.nn.state.checkpoint": "tensorpar/nn/state",
              "tensorpar.nn.state.replica_check": "tensorpar/nn/state",
              "tensorpar.nn.layers._shard": "tensorpar/nn/layers"}
    one_way = {"tensorpar.nn.layers.linear": {"tensorpar.nn.state.replica_check"},
               "tensorpar.nn.state.checkpoint": set(), "tensorpar.nn.state.replica_check": set(),
               "tensorpar.nn.layers._shard": set()}
    assert graph.folder_circles(one_way, folder) == []
    both = {**one_way, "tensorpar.nn.state.checkpoint": {"tensorpar.nn.layers._shard"}}
    assert graph.folder_circles(both, folder) == [["tensorpar/nn/layers", "tensorpar/nn/state"]]


def test_a_sub_package_s_own_init_takes_its_sub_package_s_place():
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    assert not graph.runs_back_up("tensorpar.domain._layers.pad", "tensorpar.domain._tiles")
    assert not graph.runs_back_up("tensorpar.domain._tiles.rows", "tensorpar.domain._tiles")
    assert graph.runs_back_up("tensorpar.domain._tiles", "tensorpar.domain._forward.calls")
