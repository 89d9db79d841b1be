"""Halo exchange against the dense tensor: forward rows and the gradient added back.

The reference builds every rank's extended tile from the dense tensor by index (zeros or
wrapped outside the domain); the gradient of the sum of all ranks' weighted tiles is the
dense gradient each tile's rows must receive.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.domain import halo_exchange
from tensorpar.testing import run_distributed

pytestmark = pytest.mark.timeout(600)
T = 300  # seconds; spawning a pool of ranks on a busy machine can take a minute


def _global_rows(sizes, rank, lo, hi, periodic):
    n = sum(sizes)
    off = sum(sizes[:rank])
    rows = []
    for g in range(off - lo, off + sizes[rank] + hi):
        if 0 <= g < n:
            rows.append(g)
        elif periodic:
            rows.append(g % n)
        else:
            rows.append(None)
    return rows


def _extended(full, rows, dim):
    parts = []
    for g in rows:
        if g is None:
            parts.append(torch.zeros_like(full.narrow(dim, 0, 1)))
        else:
            parts.append(full.narrow(dim, g, 1))
    return torch.cat(parts, dim) if parts else full.narrow(dim, 0, 0)


def _check_halo(sizes, lo, hi, periodic, dim):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = sum(sizes)
    shape = [2, 3, 4]
    shape.insert(dim if dim >= 0 else len(shape) + 1 + dim, n)
    torch.manual_seed(0)
    full = torch.randn(shape, dtype=torch.float64)
    d = dim % full.dim()
    off = sum(sizes[:rank])
    tile = full.narrow(d, off, sizes[rank]).clone().requires_grad_(True)
    out = halo_exchange(tile, dim=dim, sizes=sizes, halo=(lo, hi), periodic=periodic)
    # the reference: every rank's extended tile, from the dense tensor
    dense = full.clone().requires_grad_(True)
    loss = 0.0
    mine = None
    for p in range(world):
        ext = _extended(dense, _global_rows(sizes, p, lo, hi, periodic), d)
        torch.manual_seed(100 + p)
        w = torch.randn(ext.shape, dtype=torch.float64)
        loss = loss + (ext * w).sum()
        if p == rank:
            mine, my_w = ext, w
    assert out.shape == mine.shape, (out.shape, mine.shape)
    torch.testing.assert_close(out, mine.detach(), rtol=0, atol=1e-12)
    (out * my_w).sum().backward()
    loss.backward()
    torch.testing.assert_close(tile.grad, dense.grad.narrow(d, off, sizes[rank]), rtol=0,
                               atol=1e-12)
    return True


CASES_2 = [([5, 4], 1, 1, False, 2), ([5, 4], 2, 3, True, -1), ([0, 6], 2, 2, False, 1),
           ([1, 7], 3, 2, True, 0)]
CASES_3 = [([3, 5, 4], 1, 1, False, 2), ([1, 9, 6], 2, 2, False, 2),
           ([1, 9, 6], 2, 2, True, -2), ([4, 0, 5], 2, 1, True, 1), ([2, 1, 1], 3, 4, True, 0)]
CASES_4 = [([1, 1, 1, 7], 3, 3, False, 2), ([5, 0, 2, 3], 4, 2, True, -1),
           ([3, 3, 3, 3], 1, 0, True, 2)]


@pytest.mark.parametrize("case", CASES_2)
def test_halo_two_ranks(case):
    assert all(run_distributed(_check_halo, 2, *case, timeout=T))


@pytest.mark.parametrize("case", CASES_3)
def test_halo_three_ranks(case):
    assert all(run_distributed(_check_halo, 3, *case, timeout=T))


@pytest.mark.parametrize("case", CASES_4)
def test_halo_four_ranks(case):
    assert all(run_distributed(_check_halo, 4, *case, timeout=T))


def test_halo_one_rank_periodic_wraps_itself():
    x = torch.arange(3.0, requires_grad=True)
    y = halo_exchange(x, dim=0, sizes=[3], halo=4, periodic=True)
    assert y.tolist() == [2.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    y.sum().backward()
    assert x.grad.tolist() == [4.0, 3.0, 4.0]


def test_halo_arguments_are_checked():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="sizes"):
        halo_exchange(x, dim=0, sizes=[3, 1], halo=1)
    with pytest.raises(ValueError, match="rows along dim"):
        halo_exchange(x, dim=0, sizes=[2], halo=1)
    with pytest.raises(TypeError, match="halo"):
        halo_exchange(x, dim=0, sizes=[3], halo=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        halo_exchange(x, dim=0, sizes=[3], halo=(-1, 0))


def _double_backward():
    rank = dist.get_rank()
    sizes = [3, 2]
    torch.manual_seed(0)
    full = torch.randn(5, dtype=torch.float64)
    tile = full[sum(sizes[:rank]):][:sizes[rank]].clone().requires_grad_(True)
    out = halo_exchange(tile, dim=0, sizes=sizes, halo=1)
    (g,) = torch.autograd.grad((out ** 3).sum(), tile, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), tile)
    dense = full.clone().requires_grad_(True)
    ext = [torch.cat([torch.zeros(1, dtype=torch.float64), dense[:4]]),
           torch.cat([dense[2:], torch.zeros(1, dtype=torch.float64)])]
    (dg,) = torch.autograd.grad(sum((e ** 3).sum() for e in ext), dense, create_graph=True)
    (dgg,) = torch.autograd.grad(dg.sum(), dense)
    sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    torch.testing.assert_close(gg, dgg[sl], rtol=0, atol=1e-12)
    return True


def test_halo_double_backward():
    assert all(run_distributed(_double_backward, 2, timeout=T))
