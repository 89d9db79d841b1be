"""The code of docs/transformers.md runs, block after block, on 2 ranks."""

import pathlib
import re

import pytest

from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "transformers.md"


def _run(code, checkpoint_dir):
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(GUIDE), "exec"), {"checkpoint_dir": checkpoint_dir})
    return printed.getvalue()


def test_the_transformers_guide_runs_and_shows_the_real_error(tmp_path):
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    printed = run_distributed(_run, 2, "\n".join(blocks), str(tmp_path / "ckpt"), timeout=120)
    assert printed[0] == printed[1]
    shown = re.search(r"```text\n(.*?)```", text, flags=re.S).group(1)
    assert " ".join(printed[0].split()) == " ".join(shown.split())  # the page shows it as is
