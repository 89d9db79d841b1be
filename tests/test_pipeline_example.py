"""The pipeline examples run under torchrun and end with their check against dense:
examples/pipeline_lm.py (a transformers Llama) and examples/train_lm.py --pp (its own GPT)."""

import pytest

from tests.test_examples import losses, torchrun


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [("--pp", 2, "--tp", 2), ("--dp", 2, "--pp", 2, "--tp", 1,
                                                           "--virtual-stages", 2)])
def test_pipeline_lm_equals_dense(layout):
    pytest.importorskip("transformers")
    out = torchrun("pipeline_lm.py", 4, *layout, "--steps", 3)
    assert "OK: 3 steps" in out and "equal the dense model's losses" in out


# float64, so that the pipeline's microbatched losses equal the dense run's to 1e-10 (the
# example's own check); the loss starts at ln 256 = 5.5 and a run that learns is below 5
PIPELINED = ("--steps", 8, "--batch", 4, "--microbatches", 4, "--dtype", "float64",
             "--max-loss", 5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout", [(2, ("--pp", 2, "--tp", 1)),
                                          pytest.param(4, ("--pp", 2, "--tp", 2),
                                                       marks=pytest.mark.slow)])
def test_train_lm_pipelined_equals_dense(ranks, layout, tmp_path):
    out = torchrun("train_lm.py", ranks, *layout, *PIPELINED, "--out", tmp_path)
    assert f"dp 1 x pp 2 x tp {layout[-1]} (1f1b, 4 microbatches)" in out, out
    assert "check:" in out and out.rstrip().endswith("OK"), out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_lm_pipelined_stopped_and_resumed_continues_exactly(tmp_path):
    layout = ("--pp", 2, "--tp", 1, "--schedule", "gpipe", *PIPELINED)
    whole = torchrun("train_lm.py", 2, *layout, "--out", tmp_path / "whole")
    assert whole.rstrip().endswith("OK"), whole
    stopped = torchrun("train_lm.py", 2, *layout, "--stop-at", 4, "--out", tmp_path / "a")
    assert "stopped at step 4" in stopped, stopped
    resumed = torchrun("train_lm.py", 2, *layout, "--resume", "--out", tmp_path / "a")
    assert "resumed at step 4" in resumed and resumed.rstrip().endswith("OK"), resumed
    assert losses(tmp_path / "a") == losses(tmp_path / "whole")  # bit for bit
