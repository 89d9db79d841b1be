"""Convolutions on strips computed while the halo travels, and the general path beside it.

A gradient penalty (double backward) goes through the general path
(``double_backward=True``), equal to dense; the fast paths refuse it with a clear error.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed

pytestmark = pytest.mark.timeout(300)
T = 240


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(3, 1, 5, padding=2, padding_mode="circular")).double()


def _penalty(double_backward, sizes):
    rank = dist.get_rank()
    dense = _net()
    x = torch.randn(2, 2, sum(sizes), 7, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    par = parallelize_domain(copy.deepcopy(dense), dims=-2,
                             double_backward=double_backward)
    xd = x.clone().requires_grad_()
    (gd,) = torch.autograd.grad(dense(xd).square().sum(), xd, create_graph=True)
    gd.square().sum().backward()
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    try:  # create_graph=True is refused at once by the overlapped path
        (g,) = torch.autograd.grad(par(tile).square().sum(), tile, create_graph=True)
    except RuntimeError as exc:
        return str(exc)
    worst = (g - gd.narrow(2, sum(sizes[:rank]), sizes[rank])).abs().max().item()
    g.square().sum().backward()
    for p, q in zip(par.parameters(), dense.parameters(), strict=True):
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def test_double_backward_through_the_general_path_equals_dense():
    assert max(run_distributed(_penalty, 2, True, [9, 8], timeout=T)) < 1e-10
    assert max(run_distributed(_penalty, 3, True, [1, 9, 6], timeout=T)) < 1e-10


def test_double_backward_through_overlapped_convolutions_is_refused_clearly():
    for message in run_distributed(_penalty, 2, False, [9, 8], timeout=T):
        assert "double_backward=True" in message
