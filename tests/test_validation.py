"""Validation mode: each way the ranks' collectives can disagree raises the same
CollectiveMismatchError on every rank, before any data pairs with the wrong call."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tensorpar as tp
from tensorpar.testing import run_distributed


def _outcome(call):
    try:
        return "ok", call()
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _validated(case):
    with tp.validation(True):
        return _outcome(lambda: CASES[case](dist.get_rank()))


def _skipped(rank):
    if rank != 1:
        tp.all_reduce(torch.ones(3))
    return tp.all_gather(torch.ones(3))


def _op(rank):
    return tp.all_reduce(torch.ones(3), op="max" if rank == 2 else "sum")


def _dtype(rank):
    return tp.all_reduce(torch.ones(3, dtype=torch.int32 if rank == 1 else torch.float32))


def _dim(rank):
    return tp.all_gather(torch.ones(2, 2), dim=1 if rank == 1 else 0)


def _backward_mode(rank):
    return tp.all_reduce(torch.ones(3), backward="identity" if rank == 0 else "sum")


def _reduce_shape(rank):
    return tp.reduce(torch.ones(3 if rank == 0 else 4), dst=0)


def _gather_dst_with_sizes(rank):
    return tp.gather(torch.ones(2), dst=rank % 2, sizes=[2] * dist.get_world_size())


def _backward_collective(rank):
    x = torch.ones(4, requires_grad=True)
    y = tp.all_gather(x)
    z = y.sum() if rank == 0 else y.detach().sum() * 0  # rank 1 never runs the backward
    if rank == 0:
        z.backward()  # issues the backward reduce_scatter
    return tp.all_reduce(torch.ones(1))  # rank 1's next collective


def _train(rank, skip_batch=None, no_sync_rank=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reducer = tp.BucketedAllReduce(model)
    for step in range(4):
        x = torch.randn(5, 4)
        loss = model(x).square().mean()
        if rank == skip_batch and step == 1:
            continue  # "caught an error and skipped the batch": no backward
        if rank == no_sync_rank and step == 1:
            with reducer.no_sync():
                loss.backward()
            continue
        loss.backward()
    return reducer.iterations


CASES = {
    "skipped": _skipped, "op": _op, "dtype": _dtype, "dim": _dim,
    "backward mode": _backward_mode, "reduce shape": _reduce_shape,
    "gather dst with sizes": _gather_dst_with_sizes, "backward collective": _backward_collective,
    "skipped batch": lambda rank: _train(rank, skip_batch=1),
    "no_sync on one rank": lambda rank: _train(rank, no_sync_rank=0),
}

EXPECTED = {
    "skipped": (3, 'all_reduce #1 on a group of 3: operation differs: ranks 0,2 "all_reduce", '
                   'rank 1 "all_gather" (a rank skipped a collective or issued another one)'),
    "op": (3, 'all_reduce #1 on a group of 3: op differs: ranks 0,1 "sum", rank 2 "max"'),
    "dtype": (2, "all_reduce #1 on a group of 2: dtype differs: rank 0 float32, rank 1 int32"),
    "dim": (2, "all_gather #1 on a group of 2: dim differs: rank 0 dim=0, rank 1 dim=1"),
    "backward mode": (2, 'all_reduce #1 on a group of 2: backward mode differs: rank 0 '
                         '"identity", rank 1 "sum"'),
    "reduce shape": (2, "reduce #1 on a group of 2: shape differs: rank 0 [3], rank 1 [4]"),
    "gather dst with sizes": (2, "gather #1 on a group of 2: src/dst differs: "
                                 "rank 0 src/dst=0, rank 1 src/dst=1"),
    "backward collective": (2, 'reduce_scatter #2 on a group of 2: operation differs: rank 0 '
                               '"reduce_scatter", rank 1 "all_reduce"'),
    "skipped batch": (2, "BucketedAllReduce bucket #5 on a group of 2: reducer forward passes "
                         "differs: rank 0 2, rank 1 3 (a rank skipped a batch"),
    "no_sync on one rank": (2, "BucketedAllReduce bucket #5 on a group of 2: no_sync backward "
                               "passes since the last synchronised one differs: rank 0 1, "
                               "rank 1 0 (no_sync() on some ranks only)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mismatch_raises_the_same_error_on_every_rank(case):
    world_size, message = EXPECTED[case]
    results = run_distributed(_validated, world_size, case, timeout=30)
    # sequence numbers count every checked collective on the group since it was made
    message = re.sub(r"#\d+ ", "#N ", message)
    for cls, text in results:
        assert cls == "CollectiveMismatchError", results
        assert message in re.sub(r"#\d+ ", "#N ", text), (text, message)
    assert len({text for _, text in results}) == 1  # the same words everywhere


def _agreeing_calls():
    rank = dist.get_rank()
    with tp.validation(True):
        x = torch.randn(2 * rank + 1, 3, dtype=torch.float64, requires_grad=True)
        y = tp.all_gather(x, dim=-2)  # -2 and 0 name the same dim
        z = tp.reduce_scatter(y * 2, dim=0)
        w = tp.all_to_all(z.detach(), split_dim=1, concat_dim=0)
        s = tp.scatter(torch.arange(6.0) if rank == 0 else None, src=0)
        b = tp.broadcast(s.sum().reshape(1) if rank == 1 else None, src=1)
        (z.sum() + tp.all_reduce(b).sum()).backward()
        assert tp.validation_enabled()
    assert not tp.validation_enabled()
    return tuple(w.shape), x.grad, s, b.detach(), y.detach(), x.detach()


def test_agreeing_ranks_pass_and_the_switch_is_restored():
    p = 3
    results = run_distributed(_agreeing_calls, p, timeout=30)
    gathered = torch.cat([result[-1] for result in results])  # 1 + 3 + 5 = 9 rows
    for rank, (w_shape, x_grad, s, b, y, x) in enumerate(results):
        torch.testing.assert_close(y, gathered, rtol=0, atol=0)
        # z = reduce_scatter(2 y) of p equal copies: every element of x reaches the loss
        # through every rank's z, twice each: d loss / d x = 2 p
        torch.testing.assert_close(x_grad, torch.full_like(x, 2.0 * p))
        assert w_shape == (p * 3, 1)  # (rows / p, 3) split along dim 1, concatenated on 0
        torch.testing.assert_close(s, torch.arange(2.0 * rank, 2.0 * rank + 2))
        torch.testing.assert_close(b, torch.tensor([5.0]))  # rank 1's chunk: 2 + 3


def test_the_switch_works_globally_and_as_a_context_manager():
    assert not tp.validation_enabled()
    tp.validation(True)
    try:
        assert tp.validation_enabled()
        with tp.validation(False):
            assert not tp.validation_enabled()
        assert tp.validation_enabled()
    finally:
        tp.validation(False)
    assert not tp.validation_enabled()
    assert tp.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # one rank: nothing to compare
