"""Pipeline parallelism: every schedule equals the dense model (loss, gradients, AdamW steps)."""

import contextlib
import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar
import tensorpar as tp
from tensorpar.pipeline import bubble_fraction, build_schedule, recv, send
from tensorpar.pipeline.schedules import in_order, timeline
from tensorpar.testing import run_distributed

TOL = 1e-10
WIDTHS = (5, 6, 4, 7, 3, 5, 6, 2)  # 7 blocks of changing widths: each boundary its own shape


def sequential(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh())
                           for a, b in itertools.pairwise(WIDTHS)]).double()


def batch(n, step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, WIDTHS[0], generator=g, dtype=torch.float64),
            torch.randn(n, WIDTHS[-1], generator=g, dtype=torch.float64))


def _compare(pipe, dense, loss, dense_loss, what):
    if pipe.is_last:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=TOL, atol=TOL, msg=what)
    else:
        assert tp.is_placeholder(loss)
    grads = dict(dense.named_parameters())
    names = []
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL,
                                   msg=f"{what}: {name}")
        names.append(name)
    return names


def _sequential_matches_dense(schedule, virtual, n, microbatches, split, steps):
    dense = sequential()
    pipe = tp.nn.pipeline(sequential(), microbatches=microbatches, schedule=schedule,
                          loss_fn=F.mse_loss, virtual_stages=virtual, split=split)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(n, step)
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        dense_loss = F.mse_loss(dense(x), y)
        dense_loss.backward()
        names = _compare(pipe, dense, loss, dense_loss, f"step {step}")
        opt.step(), dense_opt.step(), opt.zero_grad(), dense_opt.zero_grad()
    params = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=TOL, atol=TOL, msg=name)
    return sorted({name.split(".")[0] for name in names}, key=int)


CASES = {  # schedule, virtual stages, batch, microbatches, split per world size
    "gpipe-10x4": ("gpipe", 1, 10, 4, None),
    "1f1b-10x4": ("1f1b", 1, 10, 4, None),
    "1f1b-13x5": ("1f1b", 1, 13, 5, None),
    "interleaved-10x4": ("1f1b", 2, 10, 4, None),
    "interleaved-13x5": ("1f1b", 2, 13, 5, None),
    "gpipe-interleaved-13x5": ("gpipe", 2, 13, 5, None),
    "zero-bubble-10x4": ("zero-bubble", 1, 10, 4, None),
    "zero-bubble-13x5": ("zero-bubble", 1, 13, 5, None),
    "zero-bubble-interleaved-10x4": ("zero-bubble", 2, 10, 4, None),
    "zero-bubble-interleaved-13x5": ("zero-bubble", 2, 13, 5, None),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sequential_equals_dense(case, world_size):
    results = run_distributed(_sequential_matches_dense, world_size, *CASES[case], 3,
                              timeout=100)
    blocks = [b for r in results for b in r]
    assert sorted(blocks, key=int) == [str(i) for i in range(7)]  # each block on one rank
    if CASES[case][1] == 1:  # contiguous and balanced like tensor_split: 7 on 3 -> 3, 2, 2
        sizes = [len(r) for r in results]
        assert sizes == ([4, 3] if world_size == 2 else [3, 2, 2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_split(world_size):
    split = [1, 6] if world_size == 2 else [4, 1, 2]
    results = run_distributed(_sequential_matches_dense, world_size, "1f1b", 1, 10, 4, split, 3,
                              timeout=100)
    assert [len(r) for r in results] == split


def _sizes_change_between_steps(virtual, sizes, post_ahead, limit, schedule="1f1b"):
    default = tensorpar.pipeline.p2p.FRAME_DATA_LIMIT
    if limit is not None:  # larger activations always travel in a second message
        tensorpar.pipeline.p2p.FRAME_DATA_LIMIT = limit
    try:  # the ranks are reused by the next test: the limit goes back after this one
        return _sizes_change(virtual, sizes, post_ahead, schedule)
    finally:
        tensorpar.pipeline.p2p.FRAME_DATA_LIMIT = default


def _sizes_change(virtual, sizes, post_ahead, schedule):
    dense = sequential()
    pipe = tp.nn.pipeline(sequential(), microbatches=4, schedule=schedule, loss_fn=F.mse_loss,
                          virtual_stages=virtual)
    pipe._eager = post_ahead  # False: receive in the schedule's order, as on NCCL
    for step, n in enumerate(sizes):
        x, y = batch(n, step)
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        dense_loss = F.mse_loss(dense(x), y)
        dense_loss.backward()
        _compare(pipe, dense, loss, dense_loss, f"step {step}, batch {n}")
        pipe.zero_grad(), dense.zero_grad()
        # the step's actions, each forward and backward of every microbatch once, in order
        timeline = pipe.last_timeline
        kinds = "FBW" if schedule == "zero-bubble" else "FB"
        assert sorted((a.kind, a.microbatch) for a, _, _ in timeline) == sorted(
            (kind, i) for kind in kinds for i in range(4) for _ in range(virtual))
        assert all(0 <= s <= e for _, s, e in timeline)
        assert all(e <= s for (_, _, e), (_, s, _) in itertools.pairwise(timeline))
    return sorted(pipe._rooms_in.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,virtual,post_ahead,limit,schedule",  # not ahead: as NCCL
                         [(2, 1, True, None, "1f1b"), (3, 1, True, None, "1f1b"),
                          (2, 2, True, None, "1f1b"), (2, 1, False, None, "1f1b"),
                          (3, 1, False, None, "1f1b"), (3, 1, True, 40, "1f1b"),
                          (3, 1, True, None, "zero-bubble"), (2, 1, False, None, "zero-bubble")])
def test_activation_sizes_change_between_steps(world_size, virtual, post_ahead, limit,
                                               schedule):
    # an activation travels inside its header's message when it fits the room the same
    # transfer had in the last step: first step (no room), growing (a second message),
    # shrinking (fits, with room to spare) and repeating (fits exactly)
    sizes = (10, 7, 13, 13, 4)
    rooms = run_distributed(_sizes_change_between_steps, world_size, virtual, sizes,
                            post_ahead, limit, schedule, timeout=100)
    # what each receiving rank's frames have room for next: the last step's bytes (one
    # float64 row per microbatch), none above the limit
    room = [8 * WIDTHS[b] for b in _boundaries(world_size * virtual) for _ in range(4)]
    assert sorted(r for rank in rooms for r in rank) == sorted(
        r if limit is None or r <= limit else 0 for r in room)


def _empty_activation(post_ahead, schedule):
    # the boundary carries (rows, 0): no bytes, in the frame, both ways
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 3), nn.Tanh()).double()
    _two_stages_equal_dense(model, (4, 3), post_ahead, schedule, 2)


def _two_stages_equal_dense(model, widths, post_ahead, schedule, steps):
    """``model`` on two stages (its first block, the rest) equals dense for ``steps``
    (``widths``: its input's and output's)."""
    dense = copy.deepcopy(model)
    pipe = tp.nn.pipeline(model, microbatches=2, loss_fn=F.mse_loss,
                          split=[1, len(model) - 1], schedule=schedule)
    pipe._eager = post_ahead
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, widths[0], generator=g, dtype=torch.float64)
        y = torch.randn(4, widths[1], generator=g, dtype=torch.float64)
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        dense_loss = F.mse_loss(dense(x), y)
        dense_loss.backward()
        _compare(pipe, dense, loss, dense_loss, f"step {step}")
        pipe.zero_grad(), dense.zero_grad()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("post_ahead,schedule", [(True, "1f1b"), (False, "1f1b"),
                                                 (True, "gpipe")])
def test_an_activation_with_no_elements(post_ahead, schedule):
    run_distributed(_empty_activation, 2, post_ahead, schedule, timeout=50)


def _in_place_at_the_boundary(post_ahead, schedule):
    # the receiving stage starts with an in-place op on the received activation
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    _two_stages_equal_dense(model, (5, 3), post_ahead, schedule, 3)  # step 2 on: in the frame


@pytest.mark.timeout(60)
@pytest.mark.parametrize("post_ahead,schedule", [(True, "1f1b"), (False, "1f1b"),
                                                 (True, "zero-bubble")])
def test_a_received_activation_may_be_modified_in_place(post_ahead, schedule):
    run_distributed(_in_place_at_the_boundary, 2, post_ahead, schedule, timeout=50)


class _Ignores(nn.Module):
    """A block that does not use its input (its output: a parameter, one row per sample)."""

    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, dtype=torch.float64))

    def forward(self, x):
        return self.w.expand(x.shape[0], -1)


def _stage_ignores_its_input(schedule, width, virtual=1):
    torch.manual_seed(0)
    ahead = dist.get_world_size() - 1  # the stages before the one that ignores its input
    blocks = [nn.Linear(5, width), *(nn.LayerNorm(width) for _ in range(ahead - 1))]
    dense = nn.Sequential(*blocks, _Ignores(width), nn.Linear(width, 3),
                          *([nn.Tanh()] if virtual > 1 else [])).double()
    pipe = tp.nn.pipeline(copy.deepcopy(dense), microbatches=3, schedule=schedule,
                          loss_fn=F.mse_loss, split=[1] * ahead + [2] if virtual == 1 else None,
                          virtual_stages=virtual)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    dense_loss = F.mse_loss(dense(x), y)
    dense_loss.backward()
    if pipe.is_last:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=TOL, atol=TOL)
    grads = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():  # the first block: no gradient, as dense
        if grads[name].grad is None:
            assert p.grad is None, f"{name}: a gradient where dense has none"
        else:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL, msg=name)
    # so an optimizer skips what dense skips (AdamW's decay would move a zero gradient's)
    for params in (pipe.parameters(), dense.parameters()):
        torch.optim.AdamW(params, lr=0.1, weight_decay=0.1).step()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, grads[name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble"])
@pytest.mark.parametrize("width", [4, 1 << 16])  # (a gradient too large for its frame)
def test_a_stage_that_ignores_its_input_sends_no_gradient(schedule, width):
    # the sender waits for the gradient of what it sent (it used to wait forever), and
    # learns that none comes: its stage's gradients stay None, as dense's
    run_distributed(_stage_ignores_its_input, 2, schedule, width, timeout=50)
    if width == 4:  # interleaved: each rank holds two stages
        run_distributed(_stage_ignores_its_input, 2, schedule, width, 2, timeout=50)
    # two stages before it: the middle one passes "no gradient" on (it sent zeros)
    run_distributed(_stage_ignores_its_input, 3, schedule, width, timeout=50)


class _Checkpointed(nn.Module):
    def __init__(self, block, reentrant):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def _checkpointed_stages(reentrant):
    dense, model = sequential(), sequential()
    for i in (1, 5):  # one block on each stage of 2
        model[i] = _Checkpointed(model[i], reentrant)
    pipe = tp.nn.pipeline(model, microbatches=4, schedule="zero-bubble", loss_fn=F.mse_loss)
    x, y = batch(10, 0)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    dense_loss = F.mse_loss(dense(x), y)
    dense_loss.backward()
    grads = {n.replace(".block", ""): p for n, p in pipe.named_parameters()}
    dense_grads = dict(dense.named_parameters())
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, dense_grads[name].grad, rtol=TOL, atol=TOL, msg=name)
    if pipe.is_last:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=TOL, atol=TOL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reentrant", [True, False])
def test_zero_bubble_with_activation_checkpoints(reentrant):
    # a reentrant checkpoint cannot be split (its stage runs whole backwards in B): right
    run_distributed(_checkpointed_stages, 2, reentrant, timeout=50)


def _weights_wait_for_their_w(world_size):
    from tensorpar.pipeline import split_backward

    dense, pipe = sequential(), tp.nn.pipeline(sequential(), microbatches=5,
                                               schedule="zero-bubble", loss_fn=F.mse_loss)
    seen = []  # before each W: its groups of weights, whether every gradient is still None
    run = split_backward.WeightGrads.run

    def watched(self):
        seen.append((len(self.groups), all(p.grad is None for p in pipe.parameters())))
        run(self)

    split_backward.WeightGrads.run = watched
    x, y = batch(13, 0)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    dense_loss = F.mse_loss(dense(x), y)
    dense_loss.backward()
    _compare(pipe, dense, loss, dense_loss, "zero-bubble")
    kinds = [a.kind for a, _, _ in pipe.last_timeline]
    return kinds, seen, len(pipe.stage_modules())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_bubble_defers_the_weight_gradients(world_size):
    # B leaves every weight's gradient alone (it computes the input's only); W adds them.
    # The first stage has no input to split at: its B does nothing, its W everything.
    results = run_distributed(_weights_wait_for_their_w, world_size, world_size, timeout=50)
    for rank, (kinds, seen, pipe_blocks) in enumerate(results):
        assert kinds.count("W") == kinds.count("B") == kinds.count("F") == 5
        first_w = kinds.index("W")
        assert "B" in kinds[:first_w]  # a W follows its B, later
        assert len(seen) == 5 and seen[0][1]  # no weight gradient before the first W
        # a group per linear layer (weight and bias); none on the first stage
        assert all(groups == (0 if rank == 0 else pipe_blocks) for groups, _ in seen)
    rows = build_schedule("zero-bubble", world_size, 5)
    assert [[a.kind for a in row] for row in rows] == [r[0] for r in results]


def _boundaries(stages):
    """The block index after which each stage boundary falls (7 blocks, tensor_split)."""
    ends = [len(part) for part in torch.tensor_split(torch.arange(7), stages)]
    return list(itertools.accumulate(ends))[:-1]


def test_single_process_pipeline_equals_dense():
    assert _sequential_matches_dense("1f1b", 3, 13, 5, None, 2) == [str(i) for i in range(7)]


# ---------------------------------------------------------------------------------------
# schedules as data
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("virtual", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
def test_schedule_runs_everything_once(schedule, ranks, virtual, microbatches):
    rows = build_schedule(schedule, ranks, microbatches, virtual)
    actions = [a for row in rows for a in row]
    kinds = 3 if schedule == "zero-bubble" else 2
    assert len(actions) == len(set(actions)) == kinds * microbatches * ranks * virtual
    for r, row in enumerate(rows):
        assert all(a.stage % ranks == r for a in row)
        live, peak = set(), 0  # microbatches whose activations the rank holds
        backward_done = set()
        for a in row:
            key = (a.microbatch, a.stage)
            if a.kind == "F":
                live.add(key)
            elif a.kind == "B" and schedule != "zero-bubble":
                live.remove(key)
            elif a.kind == "B":
                backward_done.add(key)
            else:  # a W after its own B, and it frees the activations
                assert key in backward_done
                live.remove(key)
            peak = max(peak, len(live))
        if schedule == "1f1b" and virtual == 1:  # 1F1B bounds live microbatches
            assert peak <= ranks - r
        if schedule == "zero-bubble" and virtual == 1:  # held until W: 1F1B's bound and
            assert peak <= ranks - r + ranks - 1  # the W it defers
        if schedule == "zero-bubble" and virtual > 1:  # interleaved 1F1B's, and those W
            assert peak <= (ranks - r - 1) * 2 + (virtual - 1) * ranks + 1 + ranks


# ---------------------------------------------------------------------------------------
# point-to-point Functions
# ---------------------------------------------------------------------------------------

def _send_recv_round_trip(shape):
    rank = dist.get_rank()
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    if rank == 0:
        ph = send(w * 2, dst=1, tag=3)
        assert tp.is_placeholder(ph) and ph.shape == torch.Size(shape) and ph.owner == 1
        ph.backward()  # receives the gradient of w * 2 from rank 1
        return w.grad
    x = recv(src=0, tag=3)
    assert x.requires_grad and x.shape == torch.Size(shape)
    (x ** 3).sum().backward()  # sends 3 x^2 back
    return x.detach()


@pytest.mark.timeout(60)
def test_send_backward_receives_the_gradient():
    for shape in [(3, 4), (2, 5, 1)]:  # a new shape per call: no shape inference, no rebuild
        grad, received = run_distributed(_send_recv_round_trip, 2, shape, timeout=50)
        torch.manual_seed(0)
        w = torch.randn(shape, dtype=torch.float64)
        torch.testing.assert_close(received, 2 * w, rtol=0, atol=0)
        torch.testing.assert_close(grad, 2 * 3 * (2 * w) ** 2, rtol=TOL, atol=TOL)


def test_errors_on_every_rank_before_communicating():
    with pytest.raises(ValueError, match="schedule='zb'"):
        tp.nn.pipeline(sequential(), microbatches=2, schedule="zb", loss_fn=F.mse_loss)
    from tensorpar.pipeline import split_backward

    split_backward.SUPPORTED = False  # as on torch 2.4
    try:
        with pytest.raises(ValueError, match=r"needs torch 2\.5 or later"):
            tp.nn.pipeline(sequential(), microbatches=2, schedule="zero-bubble",
                           loss_fn=F.mse_loss)
    finally:
        split_backward.SUPPORTED = True
    with pytest.raises(ValueError, match="loss_fn"):
        tp.nn.pipeline(sequential(), microbatches=2)
    with pytest.raises(ValueError, match=r"split=\[3, 3\]"):
        tp.nn.pipeline(sequential(), microbatches=2, loss_fn=F.mse_loss, split=[3, 3])
    with pytest.raises(ValueError, match=r"7 blocks of the nn.Sequential cannot fill 8"):
        tp.nn.pipeline(sequential(), microbatches=2, loss_fn=F.mse_loss, virtual_stages=8)
    with pytest.raises(TypeError, match=r"causal LM or a model with pipeline_blocks\(\)"):
        tp.nn.pipeline(nn.Linear(2, 2), microbatches=2, loss_fn=F.mse_loss)
    pipe = tp.nn.pipeline(sequential(), microbatches=4, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="microbatches=4"):
        pipe.step(*batch(3, 0))


def _bad_batch_raises_everywhere(rows_in, rows_target):
    pipe = tp.nn.pipeline(sequential(), microbatches=4, loss_fn=F.mse_loss)
    x, y = batch(10, 0)
    try:
        pipe.step(x[:rows_in] if pipe.is_first else None, y[:rows_target] if pipe.is_last else None)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_bad_batch_on_one_rank_raises_on_every_rank():
    messages = run_distributed(_bad_batch_raises_everywhere, 3, 2, 10, timeout=50)
    assert "shape (2, 5)" in messages[0]
    assert all("invalid inputs" in m for m in messages[1:])
    messages = run_distributed(_bad_batch_raises_everywhere, 3, 10, 9, timeout=50)
    assert all("a batch of 10 rows and the last stage a target of 9 rows" in m
               for m in messages)


def _no_grad_on_one_rank(rank_without):
    pipe = tp.nn.pipeline(sequential(), microbatches=4, loss_fn=F.mse_loss)
    x, y = batch(10, 0)
    grads = contextlib.nullcontext() if dist.get_rank() != rank_without else torch.no_grad()
    try:
        with grads:
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank_without", [0, 1])
def test_gradients_off_on_one_rank_only_raise_on_every_rank(rank_without):
    # the last stage without them: every rank hung; the first: its stage got no gradient
    # (the next stage read the activation as unused), silently
    messages = run_distributed(_no_grad_on_one_rank, 2, rank_without, timeout=50)
    assert all("gradients enabled on some ranks only" in m for m in messages), messages


def test_schedules_receive_in_the_order_peers_send():
    # what a backend that ignores tags (NCCL) needs; gloo pairs transfers by tag
    odd = set()
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        for ranks in range(2, 6):
            for virtual in range(1, 4):
                for microbatches in range(1, 13):
                    rows = build_schedule(schedule, ranks, microbatches, virtual)
                    if not in_order(rows, ranks):
                        odd.add((schedule, ranks, virtual, microbatches % 2))
    # interleaved on 2 ranks: 1F1B with an odd number of microbatches, zero-bubble always
    assert odd == {("1f1b", 2, 2, 1), ("1f1b", 2, 3, 1), ("zero-bubble", 2, 2, 0),
                   ("zero-bubble", 2, 2, 1), ("zero-bubble", 2, 3, 0), ("zero-bubble", 2, 3, 1)}


def _transfer_order(schedule, virtual, microbatches, frozen_first):
    """Each rank's receives and sends in the order it issues them: (peer, tag) lists."""
    from tensorpar.pipeline import p2p
    log = {"recv": [], "send": []}
    receive, post_send = p2p.Link.receive, p2p.Link.post_send

    def logged_receive(self, buffer):
        log["recv"].append((self.peer, self.tag))
        return receive(self, buffer)

    def logged_send(self, *tensors):
        log["send"].extend((self.peer, self.tag) for _ in tensors)
        return post_send(self, *tensors)

    p2p.Link.receive, p2p.Link.post_send = logged_receive, logged_send
    try:  # the ranks are reused by the next test: the functions go back after this one
        stages = dist.get_world_size() * virtual
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh())
                                for _ in range(stages)]).double()
        if frozen_first:  # the second stage's input needs no gradient
            model[0].requires_grad_(False)
        pipe = tp.nn.pipeline(model, microbatches=microbatches, schedule=schedule,
                              loss_fn=F.mse_loss, virtual_stages=virtual)
        pipe._eager = False
        x = torch.randn(2 * microbatches, 3, dtype=torch.float64)
        pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
    finally:
        p2p.Link.receive, p2p.Link.post_send = receive, post_send
    return log


ORDERED = [(ranks, schedule, virtual, m) for ranks in (2, 3, 4)
           for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zero-bubble", 1),
                                     ("zero-bubble", 2)) for m in (3, 6)
           if in_order(build_schedule(schedule, ranks, m, virtual), ranks)]
"""What a backend without tags runs (the others are refused there)."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frozen_first", [False, True])
@pytest.mark.parametrize("ranks,schedule,virtual,microbatches", ORDERED)
def test_a_step_receives_from_each_peer_in_the_order_it_sends(ranks, schedule, virtual,
                                                              microbatches, frozen_first):
    # as a backend that ignores tags (NCCL) pairs them: a backward deferred whole to W (an
    # input that needs no gradient) still takes its gradient at its B
    logs = run_distributed(_transfer_order, ranks, schedule, virtual, microbatches,
                           frozen_first, timeout=50)
    for rank, log in enumerate(logs):
        for peer in range(ranks):
            received = [tag for p, tag in log["recv"] if p == peer]
            sent = [tag for p, tag in logs[peer]["send"] if p == rank]
            assert received == sent, (rank, peer, received, sent)


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("1f1b", 2),
                                              ("zero-bubble", 1), ("zero-bubble", 2)])
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (2, 8), (3, 6), (4, 8), (3, 3)])
def test_schedule_bubble_is_theory(schedule, virtual, ranks, microbatches):
    rows = timeline(schedule, ranks, microbatches, virtual)
    split = schedule == "zero-bubble"  # F, B and W a tick each
    end = max(t + (1 if a.kind == "F" or split else 2) for row in rows for t, a in row)
    busy = 3 * microbatches * virtual  # ticks of work per rank: forward 1, backward 2
    assert 1 - busy / end == pytest.approx(
        bubble_fraction(ranks, microbatches, virtual, schedule=schedule))
    theory = ((ranks - 1) / (3 * virtual * microbatches + ranks - 1) if split
              else (ranks - 1) / (virtual * microbatches + ranks - 1))
    assert 1 - busy / end == pytest.approx(theory)  # zero-bubble: a third of 1F1B's wait


def _bench_rows():
    from tensorpar.bench.workloads import pipeline as bench

    return bench.run_rank(4, 1, {"width": 16, "blocks_per_rank": 4, "rows": 2})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_benchmark_suite_runs():
    rows = run_distributed(_bench_rows, 2, timeout=100)[0]
    assert [r["case"] for r in rows] == ["gpipe", "1f1b", "interleaved", "zero-bubble",
                                         "zero-bubble-interleaved"]
    for r in rows:
        assert r["tensorpar"] > 0 and r["torch"] > 0 and r["compute"] > 0
        # 1 - compute / step: below 1 always; its sign is the machine's (at this toy size on a
        # loaded machine the compute-only pass can take longer than the step it is paired with)
        for key in ("bubble", "torch_bubble", "idle", "torch_idle"):
            assert math.isfinite(r[key]) and r[key] < 1, (key, r)
    assert rows[1]["bubble_theory"] == pytest.approx(1 / 5)


def _frozen_first_stage():
    dense, model = sequential(), sequential()
    for m in (dense, model):
        m[0].requires_grad_(False)  # the first stage's output needs no gradient
    pipe = tp.nn.pipeline(model, microbatches=3, loss_fn=F.mse_loss, split=[1, 6])
    x, y = batch(7, 0)
    loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    dense_loss = F.mse_loss(dense(x), y)
    dense_loss.backward()
    _compare(pipe, dense, loss, dense_loss, "frozen first stage")


@pytest.mark.timeout(60)
def test_frozen_first_stage():
    run_distributed(_frozen_first_stage, 2, timeout=50)


def _out_of_order_refused_without_tags():
    from tensorpar.pipeline import pipe as pipe_module
    real = pipe_module._backend
    pipe_module._backend = lambda group: "nccl"  # a backend that pairs transfers by order
    try:
        messages = []
        for schedule, microbatches in (("1f1b", 3), ("zero-bubble", 4)):
            with pytest.raises(ValueError, match="cannot follow without tags") as err:
                tp.nn.pipeline(sequential(), microbatches=microbatches, schedule=schedule,
                               loss_fn=F.mse_loss, virtual_stages=2)
            messages.append(str(err.value))
        return messages
    finally:
        pipe_module._backend = real


@pytest.mark.timeout(60)
def test_an_order_a_backend_without_tags_cannot_follow_is_refused():
    for odd_1f1b, zero_bubble in run_distributed(_out_of_order_refused_without_tags, 2,
                                                 timeout=50):
        assert "divisible by 2" in odd_1f1b
        assert "3 or more ranks" in zero_bubble
