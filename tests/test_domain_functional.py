"""Convolutions and poolings called as functions inside a model's forward (a finite
difference stencil, a hand-written U-Net's ``F.max_pool2d``) are converted on tiles like
their layers: float64 within 1e-10 of dense, with an empty tile and on 2 x 2 tiles."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600


class Stencils(nn.Module):
    """A Laplacian as a fixed kernel, a learned 3x3 kernel, then the poolings."""

    def __init__(self) -> None:
        super().__init__()
        laplace = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])
        self.register_buffer("laplace", laplace.expand(2, 1, 3, 3).clone())
        self.weight = nn.Parameter(torch.randn(2, 2, 3, 3) / 3)
        self.bias = nn.Parameter(torch.randn(2))
        self.act = nn.Tanh()  # (a leaf module of its own would be refused: name it pointwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.conv2d(x, self.laplace, padding=1, groups=2)  # the stencil across the cut
        u = self.act(F.conv2d(u, self.weight, self.bias, padding="same", dilation=2))
        u = u + F.avg_pool2d(u, 3, stride=1, padding=1, count_include_pad=False)
        u = F.max_pool2d(u, 2, ceil_mode=True)
        return F.conv2d(u, self.weight, None, stride=(2, 1), padding=(1, 0))


def _stencils(sizes, mesh):
    if mesh:
        return check(Stencils, (2, 2, 9, 11), (-2, -1), ([5, 4], [6, 5]), mesh_shape=(2, 2),
                     steps=2)
    return check(Stencils, (2, 2, sum(sizes), 7), (-2,), (sizes,), steps=2)


def test_functional_convolutions_and_poolings_equal_dense():
    assert max(run_distributed(_stencils, 2, [9, 8], False, timeout=T)) < 1e-10
    assert max(run_distributed(_stencils, 3, [6, 0, 7], False, timeout=T)) < 1e-10


@pytest.mark.slow
def test_functional_convolutions_and_poolings_on_a_grid_of_tiles_equal_dense():
    assert max(run_distributed(_stencils, 4, None, True, timeout=T)) < 1e-10


class WithIndices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(F.max_pool2d(x, 2, return_indices=True)[0])


def _with_indices():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(WithIndices(), dims=-2)
    with pytest.raises(ValueError, match="the indices would be the tile"):
        model(torch.randn(1, 2, 4, 4))
    return True


def test_functional_max_pooling_with_indices_is_refused():
    assert all(run_distributed(_with_indices, 2, timeout=T))


class PadToMultiple(nn.Module):
    """Pads the rows to a multiple of 8 read from the shape: the tile's, not the domain's."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.conv, self.fixed = nn.Conv2d(2, 2, 3, padding=1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = 2 if self.fixed else -x.shape[-2] % 8
        return self.conv(F.pad(x, (1, 0, 0, rows)))


def _pad_from_shape(sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(PadToMultiple(), dims=-2)
    x = torch.randn(1, 2, sizes[torch.distributed.get_rank()], 5)
    with pytest.raises(ValueError, match="pad the split dim by different amounts"):
        model(x)
    return True


@pytest.mark.parametrize("sizes", [[8, 5], [5, 7], [6, 0, 7]])
def test_pads_that_differ_between_ranks_are_refused(sizes):
    # (they were computed from the tile's shape; [8, 5] hung: one rank did not pad at all)
    assert all(run_distributed(_pad_from_shape, len(sizes), sizes, timeout=60))


def _fixed_pad(sizes):
    return check(lambda: PadToMultiple(fixed=True), (1, 2, sum(sizes), 5), (-2,), (sizes,))


def test_a_pad_every_rank_gives_alike_equals_dense():
    assert max(run_distributed(_fixed_pad, 3, [6, 0, 7], timeout=T)) < 1e-10


class MinRows(nn.Module):
    """Pads a tile to at least 4 rows: 0 on every rank with rows, 4 on an empty one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, max(0, 4 - x.shape[-2]))))


def _min_rows(sizes):
    return check(MinRows, (1, 2, sum(sizes), 5), (-2,), (sizes,))


def test_an_empty_tile_takes_the_agreed_pad():
    # (the empty rank padded itself to 4 rows and raised; the others hung)
    assert max(run_distributed(_min_rows, 3, [8, 0, 8], timeout=60)) < 1e-10
