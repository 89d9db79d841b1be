"""What a domain-parallel convolution sends and keeps: exactly the halo rows each neighbour
needs (CommCounter, forward and backward), and saved activations per rank of a conv stack
within (tile + halo) / dense of the dense model's, plus 5%."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tensorpar
from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed

pytestmark = pytest.mark.timeout(900)
T = 600


def _exact_rows(sizes, lo, hi, rank):
    """Rows ``rank`` must send (the in-domain halo rows of the others that it owns) and
    receive (the in-domain rows of its own halo)."""
    off = [sum(sizes[:p]) for p in range(len(sizes) + 1)]
    n = off[-1]
    sent = received = 0
    for p in range(len(sizes)):
        if not sizes[p]:
            continue
        for g in [*range(off[p] - lo, off[p]), *range(off[p + 1], off[p + 1] + hi)]:
            if 0 <= g < n and off[rank] <= g < off[rank + 1]:
                sent += 1
            if 0 <= g < n and p == rank:
                received += 1
    return sent, received


def _count(sizes, k):
    rank = dist.get_rank()
    c, w = 3, 5
    conv = nn.Conv2d(c, c, k, padding=k // 2).double()
    par = parallelize_domain(copy.deepcopy(conv), dims=-2)
    x = torch.randn(1, c, sizes[rank], w, dtype=torch.float64, requires_grad=True)
    with tensorpar.CommCounter() as fwd:
        y = par(x)
    with tensorpar.CommCounter() as bwd:
        y.sum().backward()
    row = c * w * 8
    sent, received = _exact_rows(sizes, k // 2, k // 2, rank)
    return (fwd.nbytes("all_to_all"), bwd.nbytes("all_to_all"), sent * row, received * row,
            fwd.count("all_to_all"), fwd.count(purpose="meta"))


@pytest.mark.parametrize("world,sizes,k", [(2, [9, 8], 3), (3, [1, 9, 6], 5),
                                           (3, [4, 0, 6], 3)])
def test_conv_sends_exactly_the_halo_rows(world, sizes, k):
    for f, b, sent, received, n_data, n_meta in run_distributed(_count, world, sizes, k,
                                                                 timeout=T):
        assert f == sent  # each halo row once, to the rank that needs it
        assert b == received  # the backward sends each received row's gradient back
        assert n_data == 1 and n_meta == 1  # one exchange, one size exchange at the entry


def _saved_bytes(model, x):
    params = {p.data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t):
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total[0]


def _memory(height):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(8)]).double()
    x = torch.randn(1, 8, height, 32, dtype=torch.float64)
    dense = _saved_bytes(stack, x)
    sizes = [height // world + (r < height % world) for r in range(world)]
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank])
    par = parallelize_domain(copy.deepcopy(stack), dims=-2)
    mine = _saved_bytes(par, tile)
    # the halo: kernel - 1 rows per conv input (at the domain's edge, the zero padding row
    # is part of the gathered input instead of conv's implicit padding)
    halo = 2
    return mine, dense * ((sizes[rank] + halo) / height) * 1.05, dense


@pytest.mark.parametrize("world", [2, 4])
def test_saved_activations_per_rank(world):
    for mine, bound, dense in run_distributed(_memory, world, 64, timeout=T):
        assert mine <= bound, (mine, bound, dense)


def _bench_rows():
    from tensorpar.bench.workloads import domain as bench

    threads = torch.get_num_threads()
    try:
        return [bench.run_rank(name, 16, 1) for name in bench.WORKLOADS]
    finally:
        torch.set_num_threads(threads)  # the pool's ranks serve later tests


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_suite_runs():
    rows = run_distributed(_bench_rows, 2, timeout=240)[0]
    assert [r["workload"] for r in rows] == ["conv8", "unet"]
    for r in rows:
        assert r["domain"] > 0 and r["ideal"] > 0 and r["saved_bytes"][0] > 0
        assert r["shardtensor_step"]  # "ok", or why it did not run
    assert rows[0]["halo_bytes"] == rows[0]["exact_bytes"]
