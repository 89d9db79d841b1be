"""Validation mode accepts every correct program the collectives accept, with the same
results as without it: uneven chunks given by ``sizes=``, uneven tensor-parallel layers, and
ranks that reach the same collective from different arms of a branch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tensorpar as tp
from tensorpar.nn import ColumnParallelLinear
from tensorpar.testing import run_distributed


def _chunk(rank):  # rank r holds r + 1 rows
    return torch.arange(2.0 * (rank + 1), dtype=torch.float64).view(rank + 1, 2) + 10 * rank


def _weights(n):
    return torch.arange(1.0, 2 * n + 1, dtype=torch.float64).view(n, 2)


def _uneven_sizes(validate):
    rank, p = dist.get_rank(), dist.get_world_size()
    sizes = [r + 1 for r in range(p)]
    n = sum(sizes)
    with tp.validation(validate):
        x = _chunk(rank).requires_grad_()
        w = tp.gather(x * 3, dst=p - 1, sizes=sizes)
        if rank == p - 1:
            (w * _weights(n)).sum().backward()
        else:
            w.backward()  # joins the backward scatter
        y = tp.all_gather(x, sizes=sizes)
        z = tp.gather_from_group(x * 2, dim=0, sizes=sizes)
        ((y + z) * _weights(n)).sum().backward()
    return y.detach(), z.detach(), w.detach() if rank == p - 1 else None, x.grad


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_sizes_give_the_same_results_with_validation(world_size):
    on = run_distributed(_uneven_sizes, world_size, True, timeout=30)
    off = run_distributed(_uneven_sizes, world_size, False, timeout=30)
    full = torch.cat([_chunk(r) for r in range(world_size)])
    weights = _weights(full.shape[0])
    for rank, (y, z, w, grad) in enumerate(on):
        torch.testing.assert_close(y, full)
        torch.testing.assert_close(z, 2 * full)
        if rank == world_size - 1:
            torch.testing.assert_close(w, 3 * full)
        start = rank * (rank + 1) // 2
        mine = weights[start: start + rank + 1]
        # gather: once, x3; all_gather: every rank's loss counts; gather_from_group: once, x2
        torch.testing.assert_close(grad, mine * (3 + world_size + 2))
    for a, b in zip(on, off, strict=True):
        for u, v in zip(a, b, strict=True):
            if u is None:
                assert v is None
            else:
                torch.testing.assert_close(u, v, rtol=0, atol=0)


def _column_gather_output(validate, out_features):
    torch.manual_seed(0)
    dense = nn.Linear(4, out_features, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    with tp.validation(validate):
        layer = ColumnParallelLinear.from_dense(dense, gather_output=True)
        y = layer(xs)
        y.square().sum().backward()
    xd = x.clone().requires_grad_()
    expected = dense(xd)
    expected.square().sum().backward()
    s = layer.shard
    return (y.detach(), expected.detach(), xs.grad, xd.grad, layer.weight.grad,
            dense.weight.grad[s.start: s.stop])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("validate", [True, False])
def test_column_parallel_with_an_uneven_gathered_output(world_size, validate):
    out_features = 5 if world_size == 2 else 7
    for y, y_ref, x_grad, x_grad_ref, w_grad, w_grad_ref in run_distributed(
            _column_gather_output, world_size, validate, out_features, timeout=30):
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x_grad, x_grad_ref)
        torch.testing.assert_close(w_grad, w_grad_ref)


def _rank_dependent_branches():
    rank, p = dist.get_rank(), dist.get_world_size()
    with tp.validation(True):
        if rank == 0:
            s = tp.scatter(torch.arange(2.0 * p), src=0)
        else:
            s = tp.scatter(tp.TensorPlaceholder((2 * p,), torch.float32), src=0)
        if rank == 1:
            b = tp.broadcast(s * 10, src=1)
        elif rank == 0:
            b = tp.broadcast(None, src=1)
        else:
            b = tp.broadcast(tp.TensorPlaceholder((2,), torch.float32), src=1)
        total = _send(s) if rank == 0 else _receive()
        x = torch.full((1,), float(rank))
        g = tp.gather(x, dst=0) if rank == 0 else tp.gather(x + 0, dst=0)
    return s, b, total, g if rank == 0 else None


def _send(s):  # rank 0 takes a helper of its own, the others another one
    return tp.broadcast(s.sum().reshape(1), src=0)


def _receive():
    return tp.broadcast(None, src=0)


def test_ranks_may_reach_a_collective_from_different_arms_of_a_branch():
    results = run_distributed(_rank_dependent_branches, 3, timeout=30)
    for rank, (s, b, total, g) in enumerate(results):
        torch.testing.assert_close(s, torch.arange(2.0 * rank, 2.0 * rank + 2))
        torch.testing.assert_close(b, torch.tensor([20.0, 30.0]))
        torch.testing.assert_close(total, torch.tensor([1.0]))
        if rank == 0:
            torch.testing.assert_close(g, torch.tensor([0.0, 1.0, 2.0]))
