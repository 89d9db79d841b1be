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
