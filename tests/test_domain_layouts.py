"""Which dims of a tile hold which split dim's points, followed through reshapes,
transposes and permutes, on strips and on a 2 x 2 mesh: tokens split back into an image
and a channels-last detour equal dense; a converted layer given a tile known to hold its
points elsewhere than the image (transposed, also through ``.mT``) and a call that
combines a tile with its transpose (or tokens with transposed tokens) raise on every
rank."""

import functools

import pytest
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check_or_error

pytestmark = pytest.mark.timeout(300)
T = 240
TOL = 1e-10


def _tokens(y, lin, how):
    b, c, h, w = y.shape
    t = lin(y.flatten(2).transpose(1, 2))
    if how == "transpose_view":
        return t.transpose(1, 2).view(b, c, h, w)
    if how == "transpose_reshape":
        return t.transpose(1, 2).reshape(b, c, h, w)
    if how == "channels_last":
        return t.view(b, h, w, c).permute(0, 3, 1, 2)
    if how == "unflatten":
        return t.transpose(1, 2).unflatten(2, (h, w))
    return t.reshape(b, c, h, w)  # "scrambled": the channels mixed into the points


class Layouts(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)
        self.b = nn.Conv2d(4, 2, 3, padding=1)
        self.patch = nn.Conv2d(4, 4, 2, stride=2)

    def forward(self, x):
        y = self.a(x)
        if self.how == "vit":  # patches of 2 x 2 (tiles one token wide), tokens, back
            y = _tokens(self.patch(y), lambda t: self.lin(self.norm(t)), "transpose_reshape")
        elif self.how == "flatten_all":  # channels and points in one dim, and back
            b, c, h, w = y.shape
            y = (y.flatten(1) * 2).view(b, c, h, w)
        elif self.how == "convnext":  # channels-last LayerNorm and Linear, and back
            y = self.lin(self.norm(y.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        elif self.how == "transposed_twice":
            y = (y.transpose(-2, -1) * 2).transpose(-1, -2)
        elif self.how == "transposed":
            return self.b(y.transpose(-2, -1)).transpose(-2, -1)
        elif self.how == "mT":  # a property: its getter is what the mode sees
            return self.b(y.mT).mT
        elif self.how == "plus_transpose":
            y = y + y.transpose(-2, -1)
        elif self.how == "tokens_plus_transposed":  # tokens in two orders added
            b, c, h, w = y.shape
            y = (y.flatten(2) + y.transpose(-2, -1).flatten(2)).view(b, c, h, w)
        else:
            y = _tokens(y, lambda t: self.lin(self.norm(t)), self.how)
        return self.b(y)


def _run(how, hs, ws, mesh):
    return check_or_error(functools.partial(Layouts, how), hs, ws, mesh)


STRIP = (2, [3, 5], [6], None)
MESH = (4, [3, 4], [5, 2], (2, 2))
MESH_EVEN = (4, [3, 3], [3, 3], (2, 2))  # square tiles: a transpose keeps every shape
ONE_ROW = (4, [1, 6], [5, 4], (2, 2))
EMPTY = (4, [0, 7], [5, 4], (2, 2))


@pytest.mark.parametrize("how", ["transpose_view", "transpose_reshape", "channels_last",
                                 "unflatten", "convnext", "transposed_twice", "vit",
                                 "flatten_all"])
def test_followed_layouts_equal_dense(how):
    # (one-row and empty tiles: some ranks cannot read a reshape, and every rank must
    # still make the same exchanges)
    for world, hs, ws, mesh in (STRIP, MESH, MESH_EVEN, ONE_ROW, EMPTY):
        out = run_distributed(_run, world, how, hs, ws, mesh, timeout=T)
        assert all(not isinstance(o, str) and o < TOL for o in out), (world, mesh, out)


@pytest.mark.parametrize("how,says", [
    ("transposed", "takes a tile laid out as the image"), ("mT", "laid out as the image"),
    ("plus_transpose", "different dims"), ("tokens_plus_transposed", "different dims")])
def test_a_tile_not_laid_out_as_the_image_raises_on_every_rank(how, says):
    cases = (MESH_EVEN,) if "plus" in how else (STRIP, MESH, MESH_EVEN)  # (square dense)
    for world, hs, ws, mesh in cases:
        out = run_distributed(_run, world, how, hs, ws, mesh, timeout=T)
        assert all(isinstance(o, str) and says in o for o in out), (world, mesh, out)
