"""distributed_fft2 equals torch.fft.fft2 on the whole field: outputs and gradients."""

import pytest
import torch
import torch.distributed as dist

from tensorpar.nn import distributed_fft2
from tensorpar.testing import run_distributed

TOL = 1e-10


def _compare(rows, width, inverse, real):
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(3)
    dtype = torch.float64 if real else torch.complex128
    x = torch.randn(2, sum(rows), width, generator=g, dtype=dtype)
    w = torch.randn(2, sum(rows), width, generator=g, dtype=torch.complex128)
    full = x.clone().requires_grad_()
    ref = (torch.fft.ifft2 if inverse else torch.fft.fft2)(full, dim=(1, 2))
    (ref * w).real.sum().backward()
    start = sum(rows[:rank])
    mine = slice(start, start + rows[rank])
    tile = x[:, mine].clone().requires_grad_()
    out = distributed_fft2(tile, split_dim=1, other_dim=2, inverse=inverse)
    (out * w[:, mine]).real.sum().backward()
    err = (out - ref[:, mine]).abs().max().item() if out.numel() else 0.0
    gerr = (tile.grad - full.grad[:, mine]).abs().max().item() if out.numel() else 0.0
    return err, gerr, tuple(out.shape)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rows", [[1, 12], [5, 0, 8], [3, 3, 2, 1]])
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_fft2(rows, inverse):
    for rank, (err, gerr, shape) in enumerate(
            run_distributed(_compare, len(rows), rows, 7, inverse, rows[0] == 5, timeout=300)):
        assert shape == (2, rows[rank], 7)
        assert err < TOL and gerr < TOL, f"rank {rank}: output {err}, gradient {gerr}"


def test_single_rank():
    err, gerr, _ = _compare([6], 5, False, True)
    assert err < TOL and gerr < TOL
