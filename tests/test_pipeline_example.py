"""examples/pipeline_lm.py runs under torchrun and ends with its check against dense."""

import pytest

from tests.test_examples import torchrun

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [("--pp", 2, "--tp", 2), ("--dp", 2, "--pp", 2, "--tp", 1,
                                                           "--virtual-stages", 2)])
def test_pipeline_lm_equals_dense(layout):
    out = torchrun("pipeline_lm.py", 4, *layout, "--steps", 3)
    assert "OK: 3 steps" in out and "equal the dense model's losses" in out
