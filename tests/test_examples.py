"""Every example runs under torchrun on CPU and ends with its own check (small settings)."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def torchrun(script, ranks, *args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(EXAMPLES / script), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_train_lm_two_by_two(tmp_path):
    out = torchrun("train_lm.py", 4, "--steps", 25, "--max-loss", 6, "--out", tmp_path)
    assert "check:" in out and out.rstrip().endswith("OK"), out
    assert (tmp_path / "checkpoint" / ".metadata").exists()


@pytest.mark.timeout(300)
def test_placeholder_field():
    out = torchrun("placeholder_field.py", 3, "--rows", 101, "--cols", 64, "--steps", 20)
    assert "[34, 34, 33] rows each" in out and out.rstrip().endswith("OK"), out


@pytest.mark.timeout(300)
def test_ddp_swap():
    out = torchrun("ddp_swap.py", 2, "--steps", 5)
    assert "buckets, in launch order" in out and out.rstrip().endswith("OK"), out


@pytest.mark.timeout(300)
def test_hf_tensor_parallel():
    pytest.importorskip("transformers")
    out = torchrun("hf_tensor_parallel.py", 2, "--steps", 3)
    assert "tied: True" in out and out.rstrip().endswith("OK"), out
