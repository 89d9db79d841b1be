"""Calls that cut, move or join a tile's rows along a split dim (a slice, ``flip``,
``chunk``, ``cat``, ``F.unfold``...) would see the tile as if it were the whole domain: they
raise on every rank, also with an empty tile; the same calls along other dims, and slices
that keep every row of the tile, run as they are and equal dense. (A ``roll`` along a split
dim is converted: `test_domain_roll.py`; here only those that cannot be.)"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300
Cut = Callable[[torch.Tensor], torch.Tensor]


class Cuts(nn.Module):
    """Convolutions around ``cut(features)``: the call under test."""

    def __init__(self, cut: Cut) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.cut(self.conv(x)))


REFUSED: dict[str, Cut] = {
    "a slice of the rows": lambda y: y[:, :, 1:],
    "every other row": lambda y: y[..., ::2, :].repeat_interleave(2, dim=-2),
    "one row": lambda y: y[:, :, 0:1].expand_as(y).contiguous(),
    "roll of the flattened tile": lambda y: torch.roll(y, 1),
    "roll of tokens whose points are not outermost": lambda y: y.transpose(2, 3).flatten(2)
        .roll(1, 2).view(y.shape[0], y.shape[1], y.shape[3], -1).transpose(2, 3),
    "flip": lambda y: y.flip(2),
    "narrow": lambda y: y.narrow(2, 0, 1).expand_as(y).contiguous(),
    "chunk": lambda y: torch.cat(y.chunk(2, dim=2)[::-1], dim=2),
    "cat of rows": lambda y: torch.cat([y[:, :, -1:], y], dim=2)[:, :, :-1],
    "index_select": lambda y: y.index_select(2, torch.zeros(y.shape[2], dtype=torch.long)),
    "unfold": lambda y: F.fold(F.unfold(y, 3, padding=1), y.shape[-2:], 3, padding=1),
    "windows of rows": lambda y: y.unfold(2, 1, 1).squeeze(-1),
    "a row written": lambda y: y.index_fill(2, torch.tensor([0]), 0.0),
    "a slice bounded by a number": lambda y: y[:, :, :5],
    "flip with the dims apart": lambda y: y.flip(3, 2),
    "cat given axis=": lambda y: torch.cat([y, y], axis=2),
    "stack given axis=, then flip": lambda y: torch.stack([y, 2 * y], axis=-1).flip(2).sum(-1),
}
"""Each would treat the tile's rows as the domain's."""


def _refused(case, sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Cuts(REFUSED[case]).double(), dims=-2)
    x = torch.randn(1, 2, sizes[torch.distributed.get_rank()], 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="tile's rows"):
        model(x)
    return True


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_calls_that_cut_the_rows_are_refused(case):
    assert all(run_distributed(_refused, 2, case, [5, 7], timeout=T))
    assert all(run_distributed(_refused, 3, case, [4, 0, 8], timeout=T))


KEPT: dict[str, Cut] = {
    "a slice that keeps every row": lambda y: y[:, :, : y.shape[2]],
    "slices of the columns and channels": lambda y: torch.cat([y[:, :2, :, 1:],
                                                               y[:, 2:, :, :-1]], dim=1),
    "roll and flip of the columns": lambda y: torch.roll(y, 2, dims=3).flip(-1),
    "chunk and cat of the channels": lambda y: torch.cat(y.chunk(2, dim=1)[::-1], dim=1),
    "a channel picked": lambda y: y[:, 1:2] * y,
    "stack and unbind of the channels": lambda y: torch.stack(y.unbind(1)[::-1], dim=1),
    "windows of columns given dimension=": lambda y: y.unfold(dimension=3, size=1,
                                                              step=1).squeeze(-1),
}
"""Along other dims (or no cut at all): each equals dense."""


def _kept(case, sizes):
    return check(lambda: Cuts(KEPT[case]), (1, 2, sum(sizes), 6), (-2,), (sizes,), steps=1)


@pytest.mark.parametrize("case", sorted(KEPT))
def test_the_same_calls_along_other_dims_equal_dense(case):
    assert max(run_distributed(_kept, 2, case, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_kept, 3, case, [4, 0, 8], timeout=T)) < 1e-10
