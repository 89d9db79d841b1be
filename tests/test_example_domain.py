"""examples/domain_parallel.py under torchrun on 4 CPU ranks, strips and 2 x 2 tiles: it ends
with its own check against one process training the dense model, and its plot."""

import pytest

from tests.test_examples import torchrun


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tiles", ["strips", "2x2"])
def test_domain_parallel_example(tiles, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "field.png"
    out = torchrun("domain_parallel.py", 4, "--tiles", tiles, "--steps", "4", "--size", "16",
                   "--plot", plot, timeout=500)
    assert f"OK: {tiles} tiles train like one process" in out
    assert plot.stat().st_size > 0
