"""Every example runs under torchrun on CPU and ends with its own check (small settings)."""

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def torchrun(script, ranks, *args, timeout=240, check=True, restarts=0):
    """Run an example under torchrun; past ``timeout`` seconds kill it and its workers and
    fail with what it printed so far."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", f"--max-restarts={restarts}", str(EXAMPLES / script),
           *map(str, args)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # the workers run in sessions of their own: signal each one
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"{script} did not end within {timeout} s; its output so far:\n"
                        f"{stdout[-3000:]}{stderr[-3000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if not check:
        return done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _descendants(pid):
    """The processes below ``pid`` (children, their children, ...), from /proc."""
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_lm_two_by_two(tmp_path):
    # the loss starts at ln 256 = 5.5: a run that does not learn stays above 4
    out = torchrun("train_lm.py", 4, "--steps", 25, "--max-loss", 4, "--out", tmp_path)
    assert "check:" in out and out.rstrip().endswith("OK"), out
    assert (tmp_path / "checkpoints" / "step_000025" / ".metadata").exists()
    assert (tmp_path / "checkpoints" / "LATEST").read_text() == "step_000025"


# float64, so that runs at different TP sizes agree to far better than the 1e-6 asked. The
# loss starts at ln 256 = 5.5 and its mean over these 8 steps is 4.2: a run that does not
# learn stays above the ceiling.
RESUMABLE = ("--steps", 8, "--batch", 2, "--dtype", "float64", "--max-loss", 4.6)


def losses(out):
    return json.loads((out / "losses.json").read_text())


@pytest.fixture(scope="module")
def whole_losses(tmp_path_factory):
    """The uninterrupted RESUMABLE run's losses, which the resumed runs must equal (one
    launch for every test that compares with it)."""
    out = tmp_path_factory.mktemp("whole")
    printed = torchrun("train_lm.py", 4, *RESUMABLE, "--out", out)
    assert printed.rstrip().endswith("OK"), printed
    return losses(out)


def checkpoint_tensors(path, tmp):
    """Every tensor of a DCP checkpoint, by its flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(flat))
    found = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            found[prefix] = value

    walk("", torch.load(flat, weights_only=False))
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_lm_survives_a_killed_worker_with_torchrun_restarts(tmp_path):
    """One command line, repeated by torchrun after a worker is SIGKILLed at step 23: the
    job resumes from step 20 and ends bit-identical to a run that was never interrupted."""
    args = ("--steps", 30, "--batch", 2, "--dtype", "float64", "--save-every", 10,
            "--max-loss", 4.2, "--resume")
    whole = torchrun("train_lm.py", 4, *args, "--out", tmp_path / "whole", timeout=400)
    assert "no checkpoint in" in whole and whole.rstrip().endswith("OK"), whole
    killed = torchrun("train_lm.py", 4, *args, "--kill-at", 23, "--out", tmp_path / "killed",
                      restarts=1, timeout=400)
    assert "no checkpoint in" in killed, killed
    assert "resumed at step 20" in killed and "(attempt 1)" in killed, killed
    assert killed.rstrip().endswith("OK"), killed
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")  # bit for bit
    want = checkpoint_tensors(tmp_path / "whole" / "checkpoints" / "step_000030", tmp_path)
    got = checkpoint_tensors(tmp_path / "killed" / "checkpoints" / "step_000030", tmp_path)
    assert sorted(got) == sorted(want) and any(k.startswith(".model.") for k in want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_train_lm_stopped_and_resumed_at_the_same_and_another_tp_continues_exactly(
        tmp_path, whole_losses):
    expected = whole_losses
    assert len(expected) == 8
    stopped = torchrun("train_lm.py", 4, *RESUMABLE, "--stop-at", 4, "--out", tmp_path / "a")
    assert "stopped at step 4" in stopped and len(losses(tmp_path / "a")) == 4
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    # the same --tp, and --tp 4 (one data-parallel replica: the same global batch of 4)
    for out, tp_args in ((tmp_path / "a", ()), (tmp_path / "b", ("--tp", 4, "--batch", 4))):
        resumed = torchrun("train_lm.py", 4, *RESUMABLE, *tp_args, "--resume", "--out", out)
        assert "resumed at step 4" in resumed and resumed.rstrip().endswith("OK"), resumed
        assert losses(out) == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_lm_resumed_with_nothing_to_do_or_past_its_end_keeps_the_checkpoint(tmp_path):
    """A resume whose last step is the checkpoint's writes nothing (re-saving the step LATEST
    names deleted it before the copy took its place: a crash between the two lost it); one
    asked to stop before the checkpoint's step is refused (it saved step 4's state under the
    name step 2, and said OK)."""
    torchrun("train_lm.py", 4, *RESUMABLE, "--stop-at", 4, "--out", tmp_path)
    root = tmp_path / "checkpoints"
    written = (root / "step_000004" / ".metadata").stat().st_mtime_ns
    again = torchrun("train_lm.py", 4, *RESUMABLE, "--resume", "--stop-at", 4, "--out", tmp_path)
    assert "resumed at step 4" in again and "stopped at step 4: OK" in again, again
    assert (root / "step_000004" / ".metadata").stat().st_mtime_ns == written  # not re-saved
    behind = torchrun("train_lm.py", 4, *RESUMABLE, "--resume", "--stop-at", 2, "--out",
                      tmp_path, check=False)
    assert behind.returncode != 0
    assert "past the step to stop at (2)" in behind.stdout + behind.stderr, behind.stderr[-2000:]
    assert (root / "LATEST").read_text() == "step_000004"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004"]
    resumed = torchrun("train_lm.py", 4, *RESUMABLE, "--resume", "--out", tmp_path)
    assert "resumed at step 4" in resumed and resumed.rstrip().endswith("OK"), resumed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_lm_run_again_without_resume_starts_over(tmp_path):
    """The quickstart's command twice: the second run (no --resume) trained every step and
    then refused to save over the first run's checkpoint of the same step. It now sets the
    first run's checkpoints aside before it trains, and ends with its check."""
    args = (*RESUMABLE, "--stop-at", 2, "--out", tmp_path)
    first = torchrun("train_lm.py", 4, *args)
    assert "stopped at step 2: OK" in first, first
    first_losses = losses(tmp_path)
    again = torchrun("train_lm.py", 4, *args)
    assert "set aside" in again and "stopped at step 2: OK" in again, again
    assert (tmp_path / "checkpoints" / "LATEST").read_text() == "step_000002"
    assert (tmp_path / "checkpoints.previous" / "LATEST").read_text() == "step_000002"
    assert losses(tmp_path) == first_losses  # a run from step 0 again, not a resumed one


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_lm_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path,
                                                                              whole_losses):
    stopped = torchrun("train_lm.py", 4, *RESUMABLE, "--stop-at", 6, "--save-every", 2,
                       "--crash-in-save", 4, "--out", tmp_path, check=False)
    assert stopped.returncode != 0  # a rank died in the save at step 4
    root = tmp_path / "checkpoints"
    assert (root / "LATEST").read_text() == "step_000002"
    assert not (root / "step_000004").exists()
    resumed = torchrun("train_lm.py", 4, *RESUMABLE, "--resume", "--out", tmp_path)
    assert "resumed at step 2" in resumed and resumed.rstrip().endswith("OK"), resumed
    assert losses(tmp_path) == pytest.approx(whole_losses, rel=1e-6, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_placeholder_field():
    out = torchrun("placeholder_field.py", 3, "--rows", 101, "--cols", 64, "--steps", 20)
    assert "[34, 34, 33] rows each" in out and out.rstrip().endswith("OK"), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_swap():
    out = torchrun("ddp_swap.py", 2, "--steps", 5)
    assert "buckets, in launch order" in out and out.rstrip().endswith("OK"), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_tensor_parallel():
    pytest.importorskip("transformers")
    out = torchrun("hf_tensor_parallel.py", 2, "--steps", 3)
    assert "tied: True" in out and out.rstrip().endswith("OK"), out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [("--dp", 2, "--cp", 2, "--packed"),
                                    # as the docs give them: --dp is what the rest leaves
                                    ("--cp", 2, "--tp", 2, "--attention", "ulysses"),
                                    ("--cp", 4)])
def test_context_parallel_lm(layout):
    pytest.importorskip("transformers")
    out = torchrun("context_parallel_lm.py", 4, *layout, "--steps", 3)
    assert "OK: 3 steps" in out and "equal the dense model's losses" in out, out


def _train_lm_checkpoints():
    import importlib.util
    import types
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    import torch.distributed as dist
    model = torch.nn.Linear(2, 2)
    return train_lm, model, torch.optim.AdamW(model.parameters()), \
        types.SimpleNamespace(batch=2 // dist.get_world_size(), dp=dist.get_world_size(), pp=1,
                              tp=1, crash_in_save=None)  # (a global batch of 2)


def _rng_after_resume(root, seed_per_rank, step):
    """Each rank its own RNG stream (as dropout seeded per replica would be), or one for
    all: the next draws after a save and a load equal those after the save alone."""
    import torch.distributed as dist
    train_lm, model, opt, args = _train_lm_checkpoints()
    torch.manual_seed(dist.get_rank() if seed_per_rank else 7)
    train_lm.save_checkpoint(pathlib.Path(root), step, model, opt, [], args)
    want = torch.rand(4)
    torch.manual_seed(1000)  # a restarted process
    train_lm.load_checkpoint(pathlib.Path(root), model, opt, args)
    return torch.equal(torch.rand(4), want)


def _rng_at_another_world_size(root, layout=None):
    train_lm, model, opt, args = _train_lm_checkpoints()
    if layout is not None:  # the same processes as another dp x pp x tp
        args.dp, args.pp, args.tp = layout
        args.batch = 2 // args.dp
    try:
        train_lm.load_checkpoint(pathlib.Path(root), model, opt, args)
    except SystemExit as exc:
        return str(exc)
    return torch.rand(4)


@pytest.mark.timeout(120)
def test_train_lm_restores_every_rank_s_own_rng_state(tmp_path):
    # DCP keeps one copy of a tensor every rank saves under one name: one rank's RNG state
    # came back on every rank
    from tensorpar.testing import run_distributed
    assert all(run_distributed(_rng_after_resume, 2, str(tmp_path), True, 1, timeout=100))
    # at another number of processes, or another layout of as many: refused where the
    # states differ (a rank's row belongs to another position)...
    (refused,) = run_distributed(_rng_at_another_world_size, 1, str(tmp_path), timeout=100)
    assert "RNG states of their own" in refused, refused
    refused = run_distributed(_rng_at_another_world_size, 2, str(tmp_path), (1, 1, 2),
                              timeout=100)
    assert all("RNG states of their own" in r for r in refused), refused
    # ...and restored where every rank had the same
    assert all(run_distributed(_rng_after_resume, 2, str(tmp_path), False, 2, timeout=100))
    (draws,) = run_distributed(_rng_at_another_world_size, 1, str(tmp_path), timeout=100)
    torch.manual_seed(7)
    assert torch.equal(draws, torch.rand(4))


def _rng_from_an_earlier_checkpoint(root):
    """A checkpoint of the earlier format: one RNG state saved as it was, every rank's."""
    import torch.distributed.checkpoint as dcp

    import tensorpar
    train_lm, model, opt, args = _train_lm_checkpoints()
    torch.manual_seed(5)
    final = pathlib.Path(root) / "step_000001"
    dcp.save({"model": tensorpar.sharded_state_dict(model),
              "optim": tensorpar.sharded_optimizer_state_dict(model, opt),
              "loop": {"step": 1, "losses": [2.0], "rng": torch.get_rng_state(),
                       "global_batch": args.batch * args.dp}}, checkpoint_id=str(final))
    if torch.distributed.get_rank() == 0:  # (two writers: a reader could see it empty)
        (pathlib.Path(root) / "LATEST").write_text(final.name)
    torch.distributed.barrier()
    want = torch.rand(4)
    torch.manual_seed(1000)
    step, losses = train_lm.load_checkpoint(pathlib.Path(root), model, opt, args)
    return step == 1 and losses == [2.0] and torch.equal(torch.rand(4), want)


@pytest.mark.timeout(120)
def test_train_lm_resumes_a_checkpoint_of_the_earlier_format(tmp_path):
    from tensorpar.testing import run_distributed
    assert all(run_distributed(_rng_from_an_earlier_checkpoint, 2, str(tmp_path), timeout=100))
