"""A small U-Net trained for 3 SGD-with-momentum steps domain-parallel equals dense: outputs,
gradients, BatchNorm running statistics and the parameters after each step, with uneven,
narrow and 2-D tiles (the skip connections concatenate tiles of the same split: a length
keeps one split within a forward)."""

import pytest

from tensorpar.testing import run_distributed
from tests._domain_check import check
from tests._domain_unet import SmallUNet

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


def _unet(sizes, steps, ws=None, mesh=None):
    if ws is None:
        return check(SmallUNet, (2, 1, sum(sizes), 12), (-2,), (sizes,), steps=steps)
    return check(SmallUNet, (2, 1, sum(sizes), sum(ws)), (-2, -1), (sizes, ws), steps=steps,
                 mesh_shape=mesh)


def test_unet_three_steps_two_ranks():
    assert max(run_distributed(_unet, 2, [9, 7], 3, timeout=T)) < TOL


def test_unet_three_steps_three_ranks_narrow():
    assert max(run_distributed(_unet, 3, [1, 8, 7], 3, timeout=T)) < TOL


@pytest.mark.slow
def test_unet_three_steps_four_ranks_and_tiles():
    assert max(run_distributed(_unet, 4, [4, 4, 0, 8], 3, timeout=T)) < TOL
    assert max(run_distributed(_unet, 4, [7, 9], 3, [6, 6], (2, 2), timeout=T)) < TOL
