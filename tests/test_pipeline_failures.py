"""A step that raises on one rank raises on every rank of the pipeline, wherever it raises
(a later stage's loss, a stage's backward, a stage's forward): the earlier stages, which
wait for gradients, raise too instead of waiting, and a stage that finished its part
learns that the step failed. No transfer of the failed step is left to reach the next
pipeline on the same ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.testing import run_distributed

TOL = 1e-10
SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("1f1b", 2),
             "zero-bubble": ("zero-bubble", 1)}


class Boom(RuntimeError):
    """The error a test's stage raises (its ranks report its name)."""


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("backward failed")


class Faulty(nn.Module):
    """Passes its input on; raises in the forward or the backward of microbatch ``at``."""

    def __init__(self, where, at):
        super().__init__()
        self.where, self.at, self.calls = where, at, 0
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.calls += 1
        if self.where == "weight" and self.calls == self.at + 1:  # raises in W (zero-bubble)
            return F.linear(x, _Fail.apply(self.lin.weight), self.lin.bias)
        y = self.lin(x)
        if self.calls == self.at + 1:
            if self.where == "forward":
                raise Boom("forward failed")
            if self.where == "interrupt":
                raise KeyboardInterrupt
            if self.where == "backward":
                return _Fail.apply(y)
        return y


def _model(where, at, stage, stages, virtual):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(stages * virtual)]
    if where in ("forward", "backward", "interrupt", "weight"):
        blocks[stage] = Faulty(where, at)
    return nn.Sequential(*blocks).double()


def _loss_raising(at):
    """A mean squared error that raises at its call ``at`` (counting from 0; -1: never)."""
    calls = [0]

    def loss_fn(y, t):
        calls[0] += 1
        if calls[0] == at + 1:
            raise Boom("loss failed")
        return F.mse_loss(y, t)
    return loss_fn


def _batch():
    """The batch and target every test here steps on (8 rows of 4, float64)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randn(8, 4, generator=g, dtype=torch.float64))


def _failing_step(where, at, stage, schedule, virtual, post_ahead=True, fresh_group=False):
    """One step that raises on ``stage`` (``where``: "loss" on the last, "forward",
    "backward"), then, on the same ranks, a step that must equal dense. Returns the name of
    what this rank raised and the worst difference of the clean step."""
    ranks = dist.get_world_size()
    group = dist.new_group(list(range(ranks))) if fresh_group else None
    loss_fn = _loss_raising(at if where == "loss" else -1)
    pipe = tp.nn.pipeline(_model(where, at, stage, ranks, virtual), group=group,
                          microbatches=4, schedule=schedule, loss_fn=loss_fn,
                          virtual_stages=virtual)
    pipe._eager = post_ahead  # False: receive in the schedule's order, as on NCCL
    x, y = _batch()
    try:
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        raised, said = "no error", ""
    except BaseException as e:  # reported by name (an interrupt too)
        raised, said = type(e).__name__, str(e)
    if fresh_group:  # transfers of the failed step may be left on that group: not reused
        return raised, 0.0, said
    # the same ranks, a new pipeline: nothing of the failed step may reach it
    dense = _model("none", 0, 0, ranks, virtual)
    clean = tp.nn.pipeline(_model("none", 0, 0, ranks, virtual), microbatches=4,
                           schedule=schedule, loss_fn=F.mse_loss, virtual_stages=virtual)
    clean._eager = post_ahead
    return raised, _steps_off_dense(clean, dense, x, y), said


def _steps_off_dense(pipe, dense, x, y):
    """The worst difference from dense over two steps of ``pipe`` (new batches)."""
    worst = 0.0
    for _ in range(2):
        x, y = x.flip(0) * 1.5, y.flip(0)
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        dense_loss = F.mse_loss(dense(x), y)
        dense_loss.backward()
        if pipe.is_last:
            worst = max(worst, float((loss - dense_loss.detach()).abs()))
        ref = dict(dense.named_parameters())
        for name, p in pipe.named_parameters():
            worst = max(worst, float((p.grad - ref[name].grad).abs().max()))
        pipe.zero_grad(), dense.zero_grad()
    return worst


def _failing_step_in_two_messages(*args):
    """`_failing_step` with every activation and gradient past its frame's room."""
    from tensorpar.pipeline import p2p
    default, p2p.FRAME_DATA_LIMIT = p2p.FRAME_DATA_LIMIT, 16
    try:  # the ranks are reused by the next test: the limit goes back after this one
        return _failing_step(*args)
    finally:
        p2p.FRAME_DATA_LIMIT = default


def _check(results, failing_rank, error="Boom"):
    raised = [r for r, _, _ in results]
    assert raised[failing_rank] == error, raised
    assert all(r != "no error" for r in raised), raised
    assert max(w for _, w, _ in results) < TOL, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_loss_that_raises_on_the_last_stage_raises_on_every_rank(schedule, at, world_size):
    name, virtual = SCHEDULES[schedule]
    results = run_distributed(_failing_step, world_size, "loss", at, 0, name, virtual,
                              timeout=60)
    _check(results, (world_size * virtual - 1) % world_size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_stage_that_raises_raises_on_every_rank(schedule, stage, where):
    name, virtual = SCHEDULES[schedule]
    results = run_distributed(_failing_step, 3, where, 1, stage, name, virtual, timeout=60)
    _check(results, stage % 3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,at,stage", [("forward", 0, 0), ("backward", 3, 1),
                                            ("backward", 0, 3), ("forward", 3, 2)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_that_raises_on_four_ranks(schedule, where, at, stage):
    results = run_distributed(_failing_step, 4, where, at, stage, schedule, 1, timeout=60)
    _check(results, stage)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("where,at,stage", [("loss", 1, 0), ("backward", 1, 1),
                                            ("forward", 1, 1), ("backward", 2, 0),
                                            ("backward", 0, 0), ("forward", 3, 0)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_a_failed_step_raises_everywhere_when_receives_are_not_posted_ahead(
        schedule, where, at, stage, world_size):
    # as on NCCL: each receive waits in the schedule's order; the step's group is its own
    # (sends no receiver took stay in flight there)
    stage = min(stage, world_size - 1)
    results = run_distributed(_failing_step, world_size, where, at, stage, schedule, 1,
                              False, True, timeout=60)
    _check(results, world_size - 1 if where == "loss" else stage)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,stage", [(2, 0), (3, 1)])
def test_an_interrupt_on_one_rank_raises_on_every_rank(world_size, stage):
    results = run_distributed(_failing_step, world_size, "interrupt", 1, stage, "1f1b", 1,
                              timeout=60)
    _check(results, stage, "KeyboardInterrupt")


def _tied_gradient_after_a_failed_step():
    import torch.nn.functional as F

    from tests.test_pipeline_tied import _worst, data, tied
    calls = [0]

    def loss_fn(y, t):  # the second step's loss raises at its first microbatch
        calls[0] += 1
        if calls[0] == 4:
            raise Boom("loss failed")
        return F.mse_loss(y, t)

    dense = tied()
    pipe = tp.nn.pipeline(tied(), microbatches=3, schedule="gpipe", loss_fn=loss_fn,
                          split=[2, 3])
    x, y = data(0)
    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    F.mse_loss(dense(x), y).backward()
    x, y = data(1)
    raised = "no error"
    try:
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    except (Boom, tp.pipeline.NothingSent) as e:
        raised = type(e).__name__
    return raised, _worst(pipe, dense)  # no backward ran in the failed step: as after the first


@pytest.mark.timeout(60)
def test_a_failed_step_gives_the_tied_gradient_back():
    results = run_distributed(_tied_gradient_after_a_failed_step, 2, timeout=40)
    assert [r for r, _ in results] == ["NothingSent", "Boom"], results
    assert max(w for _, w in results) < TOL, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,stage", [("loss", 0), ("backward", 1), ("forward", 1)])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_failed_step_leaves_no_transfer_when_the_data_follows_its_frame(schedule, where,
                                                                          stage):
    # a gradient too large for its frame: its data's receive is posted ahead, and answered
    name, virtual = SCHEDULES[schedule]
    results = run_distributed(_failing_step_in_two_messages, 3, where, 1, stage, name,
                              virtual, timeout=60)
    _check(results, (3 * virtual - 1) % 3 if where == "loss" else stage)


@pytest.mark.timeout(60)
def test_ranks_that_finished_their_part_learn_that_the_step_failed():
    # the first stage's last backward raises: every other rank has done all its work
    results = run_distributed(_failing_step, 3, "backward", 3, 0, "1f1b", 1, timeout=40)
    assert [r for r, _, _ in results] == ["Boom", "StepFailed", "StepFailed"]
    assert "the step failed on rank 0 of the pipeline" in results[1][2], results[1][2]
    assert max(w for _, w, _ in results) < TOL, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("post_ahead", [True, False])
@pytest.mark.parametrize("schedule,at", [("zero-bubble", 0), ("zero-bubble", 1), ("1f1b", 0)])
def test_a_weight_gradient_that_raises_raises_on_every_rank(schedule, at, post_ahead,
                                                            world_size):
    # under zero-bubble the last stage raises in W, after its B sent the input's gradient:
    # the rank owes no gradient of what it took, and its sender waits for the next one
    stage = world_size - 1
    results = run_distributed(_failing_step, world_size, "weight", at, stage, schedule, 1,
                              post_ahead, not post_ahead, timeout=60)
    _check(results, stage)


def _same_pipeline_after_a_failure(schedule, virtual):
    """A loss that raises once; the same pipeline's next steps equal dense (gloo)."""
    ranks = dist.get_world_size()
    calls = [0]

    def loss_fn(y, t):
        calls[0] += 1
        if calls[0] == 2:
            raise Boom("loss failed")
        return F.mse_loss(y, t)

    dense = _model("none", 0, 0, ranks, virtual)
    pipe = tp.nn.pipeline(_model("none", 0, 0, ranks, virtual), microbatches=4,
                          schedule=schedule, loss_fn=loss_fn, virtual_stages=virtual)
    x, y = _batch()
    raised = "no error"
    try:
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    except (Boom, tp.pipeline.NothingSent, tp.pipeline.StepFailed) as e:
        raised = type(e).__name__
    pipe.zero_grad()
    return raised, _steps_off_dense(pipe, dense, x, y), ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_the_same_pipeline_runs_on_after_a_failed_step(schedule):
    name, virtual = SCHEDULES[schedule]
    _check(run_distributed(_same_pipeline_after_a_failure, 2, name, virtual, timeout=60),
           (2 * virtual - 1) % 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("post_ahead", [True, False])
@pytest.mark.parametrize("at,stage", [(0, 2), (1, 1), (1, 2), (0, 4)])
def test_a_weight_gradient_that_raises_on_interleaved_stages(at, stage, post_ahead):
    # the rank's sender may already wait for the gradient of an activation not taken yet,
    # whose backward comes before those of what was taken
    results = run_distributed(_failing_step, 3, "weight", at, stage, "zero-bubble", 2,
                              post_ahead, not post_ahead, timeout=60)
    _check(results, stage % 3)


def _fails_in_a_later_step(where, at, stage, schedule, virtual):
    """Every activation past its frame: a first step posts each data receive ahead in the
    next; the second fails (call ``at`` of the faulty block or loss counts both steps); the
    same pipeline then equals dense."""
    from tensorpar.pipeline import p2p
    default, p2p.FRAME_DATA_LIMIT = p2p.FRAME_DATA_LIMIT, 16
    try:  # the ranks are reused by the next test: the limit goes back after this one
        ranks = dist.get_world_size()
        loss_fn = _loss_raising(at if where == "loss" else -1)
        pipe = tp.nn.pipeline(_model(where, at, stage, ranks, virtual), microbatches=4,
                              schedule=schedule, loss_fn=loss_fn, virtual_stages=virtual)
        x, y = _batch()
        raised, said = "no error", ""
        for _ in range(2):
            try:
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            except (Boom, tp.pipeline.NothingSent, tp.pipeline.StepFailed) as e:
                raised, said = type(e).__name__, str(e)
        pipe.zero_grad()
        # the same blocks (a faulty one counts its own calls: one per dense step)
        dense = _model(where, at, stage, ranks, virtual)
        return raised, _steps_off_dense(pipe, dense, x, y), said
    finally:
        p2p.FRAME_DATA_LIMIT = default


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,at,stage", [("loss", 5, 0), ("forward", 5, 1),
                                            ("backward", 6, 0)])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero-bubble"])
def test_a_later_step_that_fails_answers_the_data_receives_posted_ahead(schedule, where, at,
                                                                        stage):
    name, virtual = SCHEDULES[schedule]
    results = run_distributed(_fails_in_a_later_step, 3, where, at, stage, name, virtual,
                              timeout=60)
    _check(results, (3 * virtual - 1) % 3 if where == "loss" else stage)


def _steps_after_a_failure_in_order(where, at, stage, schedule, virtual):
    """Receives in order, as on NCCL: a failed step on a group of its own; then the same
    pipeline, and a new one on that group, are refused before any transfer; a pipeline on
    another new group equals dense."""
    ranks = dist.get_world_size()
    group = dist.new_group(list(range(ranks)))
    loss_fn = _loss_raising(at if where == "loss" else -1)
    pipe = tp.nn.pipeline(_model(where, at, stage, ranks, virtual), group=group,
                          microbatches=4, schedule=schedule, loss_fn=loss_fn,
                          virtual_stages=virtual)
    pipe._eager = False
    x, y = _batch()
    again = tp.nn.pipeline(_model("none", 0, 0, ranks, virtual), group=group, microbatches=4,
                           schedule=schedule, loss_fn=F.mse_loss, virtual_stages=virtual)
    again._eager = False
    raised = []
    for p in (pipe, pipe, again):
        try:
            p.step(x if p.is_first else None, y if p.is_last else None)
            raised.append("no error")
        except (Boom, tp.pipeline.NothingSent, tp.pipeline.StepFailed) as e:
            raised.append(type(e).__name__ + ("" if "new process group" not in str(e)
                                              else ": new group"))
    fresh = tp.nn.pipeline(_model("none", 0, 0, ranks, virtual),
                           group=dist.new_group(list(range(ranks))), microbatches=4,
                           schedule=schedule, loss_fn=F.mse_loss, virtual_stages=virtual)
    fresh._eager = False
    return raised, _steps_off_dense(fresh, _model("none", 0, 0, ranks, virtual), x, y)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,at,stage", [("loss", 1, 0), ("forward", 2, 1),
                                            ("backward", 1, 1)])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_group_a_failed_step_left_sends_on_is_refused_where_receives_are_in_order(
        schedule, where, at, stage):
    name, virtual = SCHEDULES[schedule]
    results = run_distributed(_steps_after_a_failure_in_order, 3, where, at, stage, name,
                              virtual, timeout=60)
    for raised, worst in results:
        assert raised[0] != "no error", results
        assert raised[1:] == ["StepFailed: new group"] * 2, results
        assert worst < TOL, results
