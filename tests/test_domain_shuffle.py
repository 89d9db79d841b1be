"""Pixel shuffle and unshuffle over a split domain (super-resolution heads, space-to-depth
stems): ``nn.PixelShuffle`` / ``nn.PixelUnshuffle`` and ``F.pixel_shuffle`` /
``F.pixel_unshuffle`` inside a forward, on uneven, narrow and empty tiles, strips and 2 x 2
tiles, equal to dense."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300


def _shuffle(r=2):
    return nn.Sequential(nn.Conv2d(2, 2 * r * r, 3, padding=1), nn.PixelShuffle(r),
                         nn.Conv2d(2, 2, 3, padding=1))


def _unshuffle(r=2):
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.PixelUnshuffle(r),
                         nn.Conv2d(2 * r * r, 2, 3, padding=1))


class RoundTrip(nn.Module):
    """Space-to-depth, a convolution, depth-to-space, joined with the input: the shuffle's
    output has the input's length, so it takes the input's split (recorded at the entry)."""

    def __init__(self, r: int = 2, functional: bool = False) -> None:
        super().__init__()
        self.r, self.functional = r, functional
        self.mid = nn.Conv2d(2 * r * r, 2 * r * r, 3, padding=1)
        if not functional:
            self.down, self.up = nn.PixelUnshuffle(r), nn.PixelShuffle(r)
        self.out = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.functional:
            y = F.pixel_shuffle(self.mid(F.pixel_unshuffle(x, self.r)), self.r)
        else:
            y = self.up(self.mid(self.down(x)))
        return self.out(torch.cat([x, y], 1))


class Espcn(nn.Module):
    """ESPCN's shape: features at low resolution, one convolution to r * r channels per
    output channel, a pixel shuffle to the high resolution, written functionally."""

    def __init__(self, r: int = 3) -> None:
        super().__init__()
        self.r = r
        self.body = nn.Sequential(nn.Conv2d(2, 8, 5, padding=2), nn.Tanh(),
                                  nn.Conv2d(8, 4, 3, padding=1), nn.Tanh(),
                                  nn.Conv2d(4, 2 * r * r, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.pixel_shuffle(self.body(x), self.r)


MODELS = {"shuffle": _shuffle, "shuffle3": lambda: _shuffle(3), "unshuffle": _unshuffle,
          "round_trip": RoundTrip, "round_trip_functional": lambda: RoundTrip(functional=True),
          "espcn": Espcn}


def _strips(name, sizes, width=7, steps=0):
    # (relative: after SGD steps ESPCN's gradients reach the hundreds, where float64
    # rounding alone is 1e-10)
    return check(MODELS[name], (2, 2, sum(sizes), width), (-2,), (sizes,), steps=steps,
                 relative=steps > 0)


@pytest.mark.parametrize("name", ["shuffle", "shuffle3", "espcn"])
@pytest.mark.parametrize("sizes", [[5, 7], [3, 4, 5], [0, 5, 1, 6]])
def test_a_pixel_shuffle_equals_dense(name, sizes):
    assert max(run_distributed(_strips, len(sizes), name, sizes, timeout=T)) < 1e-10


@pytest.mark.parametrize("name", ["unshuffle", "round_trip", "round_trip_functional"])
@pytest.mark.parametrize("sizes", [[5, 7], [4, 8], [1, 6, 5], [0, 3, 2, 7]])
def test_a_pixel_unshuffle_equals_dense_on_tiles_its_blocks_straddle(name, sizes):
    assert max(run_distributed(_strips, len(sizes), name, sizes, 8, timeout=T)) < 1e-10


def _three_steps(name, sizes):
    return _strips(name, sizes, 8, steps=3)


@pytest.mark.parametrize("name", ["espcn", "round_trip"])
def test_three_sgd_steps_equal_dense(name):
    assert max(run_distributed(_three_steps, 3, name, [3, 4, 5], timeout=T)) < 1e-10


def _tiles(name):
    return check(MODELS[name], (1, 2, 10, 12), (-2, -1), ([3, 7], [5, 7]), mesh_shape=(2, 2))


@pytest.mark.parametrize("name", ["shuffle", "unshuffle", "round_trip", "espcn"])
def test_two_by_two_tiles_equal_dense(name):
    assert max(run_distributed(_tiles, 4, name, timeout=T)) < 1e-10


def _refused(build, shape, dims, sizes):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = parallelize_domain(build(), dims=dims)
    x = torch.randn(*shape)
    rank = dist.get_rank()
    tile = x.narrow(dims, sum(sizes[:rank]), sizes[rank])
    try:
        model(tile)
    except ValueError as e:
        return str(e)
    return "ran"


def test_a_length_the_unshuffle_does_not_divide_raises_on_every_rank():
    # 11 rows: dense raises too; rank 1's 6 rows alone would not have
    out = run_distributed(_refused, 2, _unshuffle, (1, 2, 11, 8), -2, [5, 6], timeout=T)
    assert all("pixel_unshuffle" in e and "11" in e for e in out), out


SHAPES_TORCH_REFUSES = {
    "unshuffle of an odd width": (lambda: nn.Sequential(
        nn.PixelUnshuffle(2), nn.Conv2d(8, 1, 3, padding=1)), (1, 2, 4, 5), "dim -1"),
    "shuffle of 3 channels": (lambda: nn.Sequential(
        nn.PixelShuffle(2), nn.Conv2d(1, 1, 3, padding=1)), (1, 3, 4, 4), "channels"),
}


def _torch_refuses(case, sizes):
    build, shape, _ = SHAPES_TORCH_REFUSES[case]
    return _refused(build, shape, -2, sizes)


@pytest.mark.parametrize("case", sorted(SHAPES_TORCH_REFUSES))
def test_a_shape_torch_refuses_raises_on_every_rank_an_empty_tile_too(case):
    # (an empty tile's rank would not have run torch's check, and waited in the next
    # layer's exchange for ranks that raised)
    out = run_distributed(_torch_refuses, 2, case, [0, 4], timeout=60)
    assert all(SHAPES_TORCH_REFUSES[case][2] in e for e in out), out


class VolumeShuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_shuffle(self.conv(x), 2)  # (N, C, D, H, W): D is its channel dim


def test_a_split_dim_the_shuffle_takes_for_channels_raises():
    out = run_distributed(_refused, 2, VolumeShuffle, (1, 2, 8, 4, 4), -3, [4, 4], timeout=T)
    assert all("pixel_shuffle" in e and "split dim -3" in e for e in out), out


def _moved_bytes(sizes):
    import torch.distributed as dist

    import tensorpar

    model = parallelize_domain(nn.Sequential(nn.PixelUnshuffle(2), nn.PixelShuffle(2)), dims=-2)
    x = torch.randn(1, 2, sum(sizes), 6)
    rank = dist.get_rank()
    tile = x.narrow(-2, sum(sizes[:rank]), sizes[rank]).requires_grad_(True)
    with tensorpar.CommCounter() as counter:
        y = model(tile)
        y.sum().backward()
    assert torch.equal(y, tile) and torch.equal(tile.grad, torch.ones_like(tile))
    return counter.nbytes("all_to_all")


def test_blocks_inside_the_tiles_move_no_rows_and_straddling_ones_move_theirs():
    assert run_distributed(_moved_bytes, 2, [4, 8], timeout=T) == [0, 0]
    # [5, 7]: the block of rows 4-5 straddles. The unshuffle's tiles are [3, 3]: rank 1
    # sends input row 5 (2 channels x 6 float32: 48 bytes); the shuffle's output takes the
    # entry's split [5, 7] back, so rank 0 sends its third unshuffled row (8 x 3: 96 bytes);
    # each gradient goes back the other way
    assert run_distributed(_moved_bytes, 2, [5, 7], timeout=T) == [48 + 96, 96 + 48]


def _subpixel(dims, sizes):
    from monai.networks.blocks import SubpixelUpsample

    def build():
        return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1) if dims == 3 else
                             nn.Conv2d(1, 2, 3, padding=1),
                             SubpixelUpsample(dims, 2, 2, scale_factor=2))
    shape = (2, 1, sum(sizes), 5) if dims == 2 else (1, 1, sum(sizes), 4, 3)
    return check(build, shape, (-dims,), (sizes,), steps=2, relative=True)


@pytest.mark.parametrize("dims", [2, 3])
def test_monai_s_subpixel_upsampling_equals_dense(dims):
    # (MONAI shuffles with reshapes of its own, which a tile could not follow)
    pytest.importorskip("monai")
    assert max(run_distributed(_subpixel, 3, dims, [3, 0, 4], timeout=T)) < 1e-10
    assert max(run_distributed(_subpixel, 2, dims, [1, 6], timeout=T)) < 1e-10
