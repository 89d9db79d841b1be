"""``torch.roll`` along a split dim inside a converted model: each tile takes its rows of the
rolled domain (periodic finite differences, Swin's shifted windows), equal to dense at 2, 3
and 4 ranks, on strips along H or W and on a 2 x 2 mesh, with shifts larger than a tile or
the domain; a shift read from the tile's size raises on every rank; the rows moved are the
ones the shift needs."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300
Head = Callable[[torch.Tensor], torch.Tensor]


def _laplacian(u: torch.Tensor) -> torch.Tensor:
    """A periodic five-point Laplacian, written with rolls."""
    return (u.roll(1, -2) + u.roll(-1, -2) + torch.roll(u, 1, -1) + torch.roll(u, -1, -1)
            - 4 * u)


def _shifted_windows(y: torch.Tensor) -> torch.Tensor:
    """Swin's shifted windows: roll by half a window, attend within windows of 2 rows, roll
    back."""
    b, c, h, w = y.shape
    s = torch.roll(y, shifts=(-1, -2), dims=(2, 3))
    win = s.flatten(2).transpose(1, 2).view(b, h // 2, 2 * w, c)
    out = (win @ win.transpose(-2, -1) / c).softmax(-1) @ win
    out = out.view(b, h * w, c).transpose(1, 2).view(b, c, h, w)
    return torch.roll(out, shifts=(1, 2), dims=(2, 3))


HEADS: dict[str, Head] = {
    "periodic laplacian": _laplacian,
    "roll by 3 along the rows": lambda y: y.roll(3, 2) * y,
    "roll by -5 along the rows": lambda y: torch.roll(y, -5, 2) + y,
    "roll by more than the domain": lambda y: torch.roll(y, 29, -2) - y,
    "roll by the domain's length": lambda y: torch.roll(y, 12, 2) * 2,
    "rolls along rows and channels at once": lambda y: torch.roll(y, (2, -1, 1), (2, 1, 3)),
    "roll along the rows given as keywords": lambda y: torch.roll(y, shifts=-2, dims=-2) * y,
}


class Rolled(nn.Module):
    """A convolution, the roll under test, a convolution."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _shifted_windows if self.head == "shifted windows" else HEADS[self.head]
        return self.conv2(fn(self.conv1(x)))


def _rolled(head, sizes, dim, steps=0):
    shape = (2, 2, sum(sizes), 5) if dim == -2 else (2, 2, 5, sum(sizes))
    if head == "roll by the domain's length":
        shape = (2, 2, 12, 5)
    return check(lambda: Rolled(head), shape, (dim,), (sizes,), steps=steps)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_rolls_along_the_rows_equal_dense(head):
    assert run_distributed(_rolled, 2, head, [5, 7], -2, 1, timeout=T)[0] < 1e-10
    assert max(run_distributed(_rolled, 3, head, [4, 0, 8], -2, timeout=T)) < 1e-10
    # tiles narrower than the shift: rows come from two ranks away
    assert max(run_distributed(_rolled, 4, head, [1, 6, 2, 3], -2, timeout=T)) < 1e-10


def test_a_periodic_laplacian_split_along_the_columns_equals_dense():
    assert max(run_distributed(_rolled, 2, "periodic laplacian", [3, 2], -1, timeout=T)) < 1e-10
    assert max(run_distributed(_rolled, 3, "periodic laplacian", [2, 0, 4], -1,
                               timeout=T)) < 1e-10


def test_shifted_windows_equal_dense():
    for world, sizes in ((2, [4, 8]), (3, [2, 0, 10])):
        assert max(run_distributed(_rolled, world, "shifted windows", sizes, -2, 2,
                                   timeout=T)) < 1e-10


def _mesh(head):
    return check(lambda: Rolled(head), (1, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                 mesh_shape=(2, 2))


@pytest.mark.parametrize("head", ["periodic laplacian", "rolls along rows and channels at once"])
def test_rolls_on_a_mesh_equal_dense(head):
    assert max(run_distributed(_mesh, 4, head, timeout=T)) < 1e-10


class _Roll(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Conv2d(3, 3, 1)  # a pointwise convolution: no halo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x).roll(1, 2)


def _moved(sizes):
    import tensorpar
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(_Roll().double(), dims=-2)
    rank = torch.distributed.get_rank()
    x = torch.randn(1, 3, sizes[rank], 4, dtype=torch.float64)
    with tensorpar.CommCounter() as counter, torch.no_grad():
        model.mix(x).roll(1, 2)  # (outside the converted forward: torch's own roll)
    with tensorpar.CommCounter() as inside, torch.no_grad():
        model(x)
    return counter.nbytes("all_to_all"), inside.nbytes("all_to_all")


def test_a_roll_by_one_moves_one_row_each_way():
    for outside, inside in run_distributed(_moved, 3, [5, 2, 4], timeout=T):
        assert outside == 0
        assert inside == 3 * 4 * 8  # one row of 3 channels x 4 columns, float64


def _refused(head, sizes):
    from tensorpar.nn import parallelize_domain
    rolls = {"a shift read from the tile's size": lambda y: y.roll(y.shape[2] // 2, 2),
             "a roll of the flattened tile": lambda y: y.roll(1)}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return rolls[head](self.conv(x))

    model = parallelize_domain(Model().double(), dims=-2)
    x = torch.randn(1, 2, sizes[torch.distributed.get_rank()], 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="roll"):
        model(x)
    return True


@pytest.mark.parametrize("head", ["a shift read from the tile's size",
                                  "a roll of the flattened tile"])
def test_rolls_that_cannot_be_the_dense_ones_raise_on_every_rank(head):
    assert all(run_distributed(_refused, 2, head, [5, 7], timeout=T))
    assert all(run_distributed(_refused, 3, head, [4, 0, 8], timeout=T))
