"""Norms called as functions inside a converted model's forward: ``F.group_norm`` and
``F.instance_norm`` take their statistics over the whole domain, like their layers, and
equal dense; ``F.batch_norm`` in training and ``F.layer_norm`` over a split dim raise on
every rank (their statistics would be the tile's); with fixed statistics, or over the
channels, they run as they are."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300


class Normed(nn.Module):
    """A convolution, the functional norm under test (its weight and bias parameters of
    the model), a convolution."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.weight = nn.Parameter(torch.rand(4) + 0.5)
        self.bias = nn.Parameter(torch.randn(4) / 4)
        self.register_buffer("mean", torch.randn(4) / 4)
        self.register_buffer("var", torch.rand(4) + 0.5)
        self.case = case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        w, b, case = self.weight, self.bias, self.case
        if case == "group norm":
            y = F.group_norm(y, 2, w, b)
        elif case == "group norm, no affine":
            y = F.group_norm(y, 2)
        elif case == "group norm, a weight alone":
            y = F.group_norm(y, 4, weight=w, eps=1e-3)
        elif case == "instance norm":
            y = F.instance_norm(y, weight=w, bias=b)
        elif case == "instance norm, no affine":
            y = F.instance_norm(y)
        elif case == "batch norm, running statistics":
            y = F.batch_norm(y, self.mean, self.var, w, b, training=False)
        elif case == "layer norm over the channels":
            y = F.layer_norm(y.permute(0, 2, 3, 1), (4,), w, b).permute(0, 3, 1, 2)
        elif case == "batch norm, training":
            y = F.batch_norm(y, None, None, w, b, training=True)
        elif case == "layer norm over the image":
            y = F.layer_norm(y, y.shape[-3:])
        elif case == "layer norm of a mesh's tokens as channels last":
            b, c, h, w_ = y.shape
            t = F.layer_norm(y.flatten(2).transpose(1, 2).view(b, h, w_, c), (c,))
            y = t.permute(0, 3, 1, 2)
        elif case == "layer norm of a mesh's tokens, rows and columns swapped":
            b, c, h, w_ = y.shape  # (not followed: which dim holds which points?)
            t = F.layer_norm(y.flatten(2).transpose(1, 2).view(b, w_, h, c), (c,))
            y = t.permute(0, 3, 2, 1)
        elif case == "instance norm, running statistics":
            y = F.instance_norm(y, self.mean.clone(), self.var.clone(), use_input_stats=True)
        return self.conv2(y)


EQUAL = ["group norm", "group norm, no affine", "group norm, a weight alone", "instance norm",
         "instance norm, no affine", "batch norm, running statistics",
         "layer norm over the channels"]


def _equal(case, sizes, mesh):
    if mesh:
        return check(lambda: Normed(case), (1, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                     mesh_shape=(2, 2), steps=2)
    return check(lambda: Normed(case), (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("case", EQUAL)
def test_functional_norms_equal_dense(case):
    assert max(run_distributed(_equal, 2, case, [5, 7], False, timeout=T)) < 1e-10
    assert max(run_distributed(_equal, 3, case, [4, 0, 8], False, timeout=T)) < 1e-10


@pytest.mark.parametrize("case", ["group norm", "instance norm"])
def test_functional_norms_on_a_mesh_equal_dense(case):
    assert max(run_distributed(_equal, 4, case, None, True, timeout=T)) < 1e-10


def _refused(case, sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Normed(case).double(), dims=-2)
    x = torch.randn(2, 2, sizes[torch.distributed.get_rank()], 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="domain-parallel"):
        model(x)
    return True


@pytest.mark.parametrize("case", ["batch norm, training", "layer norm over the image",
                                  "instance norm, running statistics"])
def test_functional_norms_that_would_see_the_tile_alone_raise_on_every_rank(case):
    assert all(run_distributed(_refused, 2, case, [5, 7], timeout=T))
    assert all(run_distributed(_refused, 3, case, [4, 0, 8], timeout=T))


def _mesh_refused():
    from torch.distributed.device_mesh import init_device_mesh

    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(
        Normed("layer norm of a mesh's tokens, rows and columns swapped").double(),
        dims=(-2, -1), group=init_device_mesh("cpu", (2, 2)))
    rank = torch.distributed.get_rank()
    with pytest.raises(ValueError, match="layer_norm"):  # (which dim holds the points?)
        model(torch.randn(1, 2, (2, 4)[rank // 2], (4, 3)[rank % 2], dtype=torch.float64))
    return True


def test_a_layer_norm_of_a_tile_not_followed_raises_on_every_rank():
    assert all(run_distributed(_mesh_refused, 4, timeout=T))


def test_a_layer_norm_of_a_mesh_s_tokens_as_channels_last_equals_dense():
    # the tokens split back into rows and columns are followed on a mesh too
    assert max(run_distributed(_equal, 4, "layer norm of a mesh's tokens as channels last",
                               None, True, timeout=T)) < 1e-10
