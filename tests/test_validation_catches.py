"""Validation mode catches what pairs silently without it: a skipped collective, a wrong
placeholder with ``exchange_meta=False``, different inputs to a tensor-parallel region and
``requires_grad`` that differs across ranks with ``sizes=``. Each raises
CollectiveMismatchError on every rank, and no rank returns a result."""

import time

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.nn import ColumnParallelLinear, ParallelEmbedding, VocabParallelEmbedding
from tensorpar.testing import run_distributed


def _outcome(case, *args):
    try:
        with tp.validation(True):
            result = CASES[case](dist.get_rank(), dist.get_world_size(), *args)
        return "returned", repr(result)
    except Exception as exc:
        return type(exc).__name__, str(exc)


# -- a rank skips the first of two identical calls --------------------------------------

def _skip_all_reduce(rank, p):
    if rank != 1:
        tp.all_reduce(torch.ones(3))
    return tp.all_reduce(torch.ones(3))


def _skip_all_gather(rank, p):
    if rank != 1:
        tp.all_gather(torch.ones(2))
    return tp.all_gather(torch.ones(2))


def _skip_scatter(rank, p):
    if rank != 1:
        tp.scatter(torch.arange(2.0 * p) if rank == 0 else None, src=0)
    return tp.scatter(torch.arange(2.0 * p) if rank == 0 else None, src=0)


def _skip_broadcast(rank, p):
    if rank != 1:
        tp.broadcast(torch.ones(4) if rank == 0 else None, src=0)
    return tp.broadcast(torch.ones(4) if rank == 0 else None, src=0)


def _skip_all_to_all(rank, p):  # uneven: every rank sends rank + 1 rows
    x = torch.ones(rank + 1, 2)
    if rank != 1:
        tp.all_to_all(x, split_dim=0, concat_dim=0)
    return tp.all_to_all(x, split_dim=0, concat_dim=0)


def _skip_in_a_loop(rank, p):  # the same line, one iteration fewer on rank 1
    for step in range(3):
        if rank == 1 and step == 1:
            continue
        tp.all_reduce(torch.ones(2))
    return tp.all_reduce(torch.ones(2))


def _skip_backward(rank, p):  # rank 1 skips the first of two backward passes
    x = torch.ones(2, requires_grad=True)
    a = tp.all_gather(x * 2)
    b = tp.all_gather(x * 3)
    if rank != 1:
        a.sum().backward()  # a backward reduce_scatter, the same shape as b's
    b.sum().backward()
    return x.grad


# -- exchange_meta=False with a wrong placeholder ------------------------------------------

def _wrong_placeholder_scatter(rank, p):
    shape = (2 * p, 3) if rank != 1 else (2 * p, 4)
    x = torch.ones(2 * p, 3) if rank == 0 else tp.TensorPlaceholder(shape, torch.float32)
    return tp.scatter(x, src=0, exchange_meta=False)


def _wrong_placeholder_broadcast(rank, p):
    dtype = torch.float64 if rank == 1 else torch.float32
    x = torch.ones(3) if rank == 0 else tp.TensorPlaceholder((3,), dtype)
    return tp.broadcast(x, src=0, exchange_meta=False)


def _placeholder_without_grad(rank, p):  # the source requires grad, rank 1's placeholder not
    x = torch.ones(p, requires_grad=True) if rank == 0 else \
        tp.TensorPlaceholder((p,), torch.float32, requires_grad=rank != 1)
    y = tp.scatter(x, src=0, exchange_meta=False)
    if y.requires_grad:
        y.sum().backward()
    return tp.all_reduce(torch.ones(1))


# -- a replicated input that is not the same on every rank ---------------------------------

def _column_input(rank, p):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6)
    x = torch.ones(2, 4)
    if rank == 1:
        x[1, 2] = 2.0
    return layer(x)


def _column_input_no_grad(rank, p):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6, gather_output=True)
    x = torch.arange(8.0).view(2, 4)
    if rank == p - 1:
        x = x.flip(0)  # the same values in another order
    with torch.no_grad():
        return layer(x)


def _copy_to_group_input(rank, p):
    x = torch.zeros(5, dtype=torch.float64)
    x[0] = 1e-300 if rank == 0 else 0.0
    return tp.copy_to_group(x)


def _split_to_group_input(rank, p):
    return tp.split_to_group(torch.full((3, 2 * p), float(rank == 2)), dim=-1)


def _embedding_ids(rank, p, kind, compiled=False):
    """Token ids that differ across the group (say, sampled with a per-rank seed): each rank
    looks up other tokens and the sum (or the gathered slices) mixes them, silently."""
    torch.manual_seed(0)
    layer = {"vocab": VocabParallelEmbedding, "dim": ParallelEmbedding}[kind](11, 6)
    ids = torch.tensor([[1, 4, 7], [2, 9, 10]])
    if rank == p - 1:
        ids[1, 1] = 3
    if compiled:  # (the message names the layer there too)
        torch._dynamo.reset()
        return torch.compile(layer, backend="aot_eager")(ids)
    return layer(ids)


# -- sizes= with requires_grad differing across ranks --------------------------------------

def _sizes_requires_grad(rank, p, fn):
    sizes = [r + 1 for r in range(p)]
    x = torch.ones(rank + 1, 2, requires_grad=rank == 0)
    if fn == "all_gather":
        y = tp.all_gather(x, sizes=sizes)
    elif fn == "gather_from_group":
        y = tp.gather_from_group(x, dim=0, sizes=sizes)
    else:
        y = tp.gather(x, sizes=sizes)
        if rank != 0:
            return None
    if y.requires_grad:
        y.sum().backward()
    return tp.all_reduce(torch.ones(1))


CASES = {
    "skip all_reduce": _skip_all_reduce, "skip all_gather": _skip_all_gather,
    "skip scatter": _skip_scatter, "skip broadcast": _skip_broadcast,
    "skip all_to_all": _skip_all_to_all, "skip in a loop": _skip_in_a_loop,
    "skip backward": _skip_backward,
    "placeholder scatter": _wrong_placeholder_scatter,
    "placeholder broadcast": _wrong_placeholder_broadcast,
    "placeholder requires_grad": _placeholder_without_grad,
    "column input": _column_input, "column input no_grad": _column_input_no_grad,
    "copy_to_group input": _copy_to_group_input, "split_to_group input": _split_to_group_input,
    "sizes requires_grad": _sizes_requires_grad,
    "vocab embedding ids": lambda rank, p: _embedding_ids(rank, p, "vocab"),
    "embedding ids": lambda rank, p: _embedding_ids(rank, p, "dim"),
    "vocab embedding ids compiled": lambda rank, p: _embedding_ids(rank, p, "vocab", True),
}

EXPECTED = {  # (world size, words every rank's message holds)
    "skip all_reduce": (2, ["all_reduce", "call site differs", "_skip_all_reduce"]),
    "skip all_gather": (3, ["all_gather", "call site differs"]),
    "skip scatter": (2, ["scatter", "call site differs"]),
    "skip broadcast": (3, ["broadcast", "call site differs"]),
    "skip all_to_all": (3, ["all_to_all", "call site differs"]),
    "skip in a loop": (2, ["all_reduce", "call site differs"]),
    "skip backward": (2, ["reduce_scatter", "backward", "call site differs"]),
    "placeholder scatter": (3, ["scatter", "shape differs", "[6, 3]", "[6, 4]"]),
    "placeholder broadcast": (2, ["broadcast", "dtype differs", "float32", "float64"]),
    "placeholder requires_grad": (3, ["scatter", "requires_grad differs"]),
    "column input": (2, ["copy_to_group", "ColumnParallelLinear", "input values differ"]),
    "column input no_grad": (3, ["ColumnParallelLinear", "input values differ"]),
    "copy_to_group input": (2, ["copy_to_group", "input values differ"]),
    "split_to_group input": (3, ["split_to_group", "input values differ"]),
    "vocab embedding ids": (2, ["VocabParallelEmbedding", "input values differ"]),
    "embedding ids": (3, ["ParallelEmbedding", "input values differ"]),
    "vocab embedding ids compiled": (2, ["VocabParallelEmbedding", "input values differ"]),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_raises_and_none_returns(case):
    world_size, words = EXPECTED[case]
    results = run_distributed(_outcome, world_size, case, timeout=30)
    for cls, text in results:
        assert cls == "CollectiveMismatchError", results
        for word in words:
            assert word in text, (word, text)
    assert len({text for _, text in results}) == 1, results  # the same words everywhere


@pytest.mark.parametrize("fn", ["all_gather", "gather_from_group", "gather"])
def test_sizes_with_requires_grad_on_some_ranks_raises_within_seconds(fn):
    start = time.monotonic()
    results = run_distributed(_outcome, 3, "sizes requires_grad", fn, timeout=30)
    assert time.monotonic() - start < 10
    for cls, text in results:
        assert cls == "CollectiveMismatchError", results
        assert "requires_grad differs" in text and fn in text, text
        assert "rank 0 True, ranks 1,2 False" in text, text


def _all_to_all_requires_grad_on_one_rank():
    rank, p = dist.get_rank(), dist.get_world_size()
    x = (torch.arange(2.0 * p) + 10 * rank).view(p, 2).requires_grad_(rank == 0)
    y = tp.all_to_all(x * 1, split_dim=0, concat_dim=0)
    y.mul(torch.arange(1.0, 2 * p + 1).view(p, 2)).sum().backward()  # every rank's loss counts
    return x.grad


def test_all_to_all_without_sizes_joins_every_rank_to_the_backward():
    # the metadata it exchanges anyway carries requires_grad: ranks whose input does not
    # require it still join the backward, as all_gather's do, instead of leaving rank 0
    # alone in the backward all_to_all
    grads = run_distributed(_all_to_all_requires_grad_on_one_rank, 3, timeout=30)
    p = 3
    # rank 0 sent its row r to rank r, which weighted it with its row 0 of the weights
    expected = torch.arange(1.0, 3).expand(p, 2)
    torch.testing.assert_close(grads[0], expected)
    assert grads[1] is None and grads[2] is None


def _no_exchange_requires_grad(rank, p, fn):
    x = torch.ones(2 * p, requires_grad=rank == p - 1)
    out = {"all_reduce": lambda: tp.all_reduce(x),
           "reduce_scatter": lambda: tp.reduce_scatter(x),
           "reduce": lambda: tp.reduce(x, dst=0),
           "copy_to_group": lambda: tp.copy_to_group(x)}[fn]()
    if out.requires_grad:  # without validation mode: the last rank alone in the backward
        out.sum().backward()
    return out


CASES["no exchange requires_grad"] = _no_exchange_requires_grad


@pytest.mark.parametrize("fn", ["all_reduce", "reduce_scatter", "reduce", "copy_to_group"])
def test_requires_grad_on_some_ranks_without_an_exchange_raises_instead_of_hanging(fn):
    results = run_distributed(_outcome, 3, "no exchange requires_grad", fn, timeout=30)
    for cls, text in results:
        assert cls == "CollectiveMismatchError", results
        assert "requires_grad differs" in text and fn in text, text
        assert "ranks 0,1 False, rank 2 True" in text, text


def _silent_backward_requires_grad(rank, p, fn):
    x = torch.ones(2 * p, requires_grad=rank == p - 1)
    out = {"reduce_from_group": lambda: tp.reduce_from_group(x),
           "all_reduce identity": lambda: tp.all_reduce(x, backward="identity")}[fn]()
    if out.requires_grad:  # a backward that sends nothing: ranks may differ
        out.sum().backward()
    return x.grad


CASES["silent backward requires_grad"] = _silent_backward_requires_grad


@pytest.mark.parametrize("fn", ["reduce_from_group", "all_reduce identity"])
def test_requires_grad_may_differ_where_the_backward_sends_nothing(fn):
    results = run_distributed(_outcome, 3, "silent backward requires_grad", fn, timeout=30)
    assert [cls for cls, _ in results] == ["returned"] * 3, results
