"""2-D tiles on a DeviceMesh: the halo of a tile includes its diagonal neighbours' corner
rows (the exchange along the second dim carries the halo already received along the
first). Checked with circular padding, where every tile has four corner neighbours."""

import pytest
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


def corners():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"),
                         nn.Conv2d(3, 2, 5, padding=2, padding_mode="reflect"))


def mixed():
    return nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1),
                         nn.Upsample(scale_factor=2, mode="bilinear"),
                         nn.ConvTranspose2d(4, 2, 2, stride=2), nn.GroupNorm(1, 2),
                         nn.Conv2d(2, 2, 3, padding=1, padding_mode="replicate"))


BUILDERS = {"corners": corners, "mixed": mixed}


def _run(name, hs, ws, mesh):
    return check(BUILDERS[name], (2, 2, sum(hs), sum(ws)), (-2, -1), (hs, ws), mesh_shape=mesh)


def test_two_by_two_tiles_circular_corners():
    assert max(run_distributed(_run, 4, "corners", [5, 4], [3, 6], (2, 2), timeout=T)) < TOL


def test_two_by_two_tiles_narrow():
    # a 1-wide tile column under a 5x5 kernel: rows and corners from two tiles away
    assert max(run_distributed(_run, 4, "corners", [1, 8], [6, 1], (2, 2), timeout=T)) < TOL


def test_two_by_two_tiles_mixed_layers():
    assert max(run_distributed(_run, 4, "mixed", [9, 8], [5, 6], (2, 2), timeout=T)) < TOL


def test_three_by_one_mesh():
    assert max(run_distributed(_run, 3, "corners", [3, 2, 4], [7], (3, 1), timeout=T)) < TOL
