"""``F.interpolate(y, size=x.shape[-2:])`` inside a forward asks for the size of a tile
(every size a forward reads from a tensor is its tile's): the result is the tile of that
split, as torchvision's segmentation heads and MONAI's ``RegUNet`` write it. A constant
size is the whole domain's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300


class BackToInputSize(nn.Module):
    """Features at half resolution resized back to the input tile's size, then joined."""

    def __init__(self, mode: str = "bilinear") -> None:
        super().__init__()
        self.mode = mode
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.out = nn.Conv2d(6, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.down(x), size=x.shape[-2:], mode=self.mode)
        return self.out(torch.cat([x, y], 1))


class SegmentationHead(nn.Module):
    """torchvision's way: the head's logits resized to the input's shape at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, stride=2, padding=1))
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[-2:]
        return F.interpolate(self.head(self.body(x)), size=shape, mode="bilinear",
                             align_corners=False)


MODELS = {"back_bilinear": BackToInputSize, "back_nearest": lambda: BackToInputSize("nearest"),
          "head": SegmentationHead}


def _strips(name, sizes):
    return check(MODELS[name], (2, 2, sum(sizes), 10), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("sizes", [[9, 8], [8, 8], [5, 0, 6]])
def test_a_resize_to_a_tiles_shape_equals_dense(name, sizes):
    assert max(run_distributed(_strips, len(sizes), name, sizes, timeout=T)) < 1e-10


def _grid(name):
    return check(MODELS[name], (2, 2, 17, 12), (-2, -1), ([9, 8], [6, 6]), mesh_shape=(2, 2),
                 steps=1)


@pytest.mark.parametrize("name", ["back_bilinear", "head"])
def test_a_resize_to_a_tiles_shape_equals_dense_on_a_grid_of_tiles(name):
    assert max(run_distributed(_grid, 4, name, timeout=T)) < 1e-10
