"""The code of docs/training-loop.md runs, block after block, on 4 ranks (a 2 x 2 mesh)."""

import pathlib
import re

import pytest

from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "training-loop.md"


def _run(code, checkpoint_dir):
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(GUIDE), "exec"), {"checkpoint_dir": checkpoint_dir})
    return printed.getvalue()


@pytest.mark.timeout(900)
def test_the_training_loop_guide_runs_and_prints_what_it_shows(tmp_path):
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 5
    printed = run_distributed(_run, 4, "\n".join(blocks), str(tmp_path / "ckpt"), timeout=600)
    shown = re.findall(r"```text\n(.*?)```", text, flags=re.S)[-1]
    for rank in (0, 2):  # tensor-parallel rank 0 of each replica prints every line
        assert " ".join(printed[rank].split()) == " ".join(shown.split())
    for rank in (1, 3):  # the others only the first
        assert printed[rank].strip() == shown.splitlines()[0]
    assert (tmp_path / "ckpt" / "fsdp_step_3" / ".metadata").exists()
