"""parallelize_domain on convolutions: every padding mode, stride, dilation, groups, "same"
and "valid", odd sizes, a tile narrower than the halo, an empty tile; 1-D, 2-D and 3-D.

Each case runs the dense model and the converted one on 2, 3 or 4 ranks (float64) and
requires outputs, parameter gradients and input-tile gradients within 1e-10.
"""

import pytest
import torch
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600  # seconds; spawning a pool of ranks on a busy machine can take a minute
TOL = 1e-10


def conv2d_stack(mode):
    def build():
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, padding_mode=mode),
            nn.ReLU(),
            nn.Conv2d(4, 4, 5, stride=2, padding=2, groups=2, padding_mode=mode),
            nn.Conv2d(4, 3, 3, dilation=2, padding=2, padding_mode=mode),
            nn.SiLU(),
            nn.Conv2d(3, 2, (4, 3), padding="same", padding_mode=mode),
            nn.Conv2d(2, 2, 3, stride=(3, 2), padding="valid"),
        )
    return build


def _conv2d(mode, sizes):
    return check(conv2d_stack(mode), (2, 2, sum(sizes), 10), (-2,), (sizes,))


def _conv1d(sizes):
    def build():
        return nn.Sequential(nn.Conv1d(2, 3, 5, padding=2, padding_mode="circular"),
                             nn.Conv1d(3, 3, 3, stride=2, dilation=3, padding=1),
                             nn.Conv1d(3, 2, 4, padding="same", padding_mode="reflect"))
    return check(build, (2, 2, sum(sizes)), (-1,), (sizes,))


def _conv3d(sizes):
    def build():
        return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate"),
                             nn.Conv3d(3, 2, (3, 1, 3), stride=2, padding=(1, 0, 1)))
    return check(build, (1, 2, sum(sizes), 5, 6), (-3,), (sizes,))


MODES = ["zeros", "circular", "reflect", "replicate"]


@pytest.mark.parametrize("mode", MODES)
def test_conv2d_two_ranks(mode):
    assert max(run_distributed(_conv2d, 2, mode, [9, 8], timeout=T)) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_conv2d_three_ranks_narrow_tile(mode):
    # a 1-row tile under a 5x5 kernel: its halo comes from two ranks away
    assert max(run_distributed(_conv2d, 3, mode, [1, 9, 7], timeout=T)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_conv2d_four_ranks_empty_tile(mode):
    assert max(run_distributed(_conv2d, 4, mode, [6, 0, 1, 10], timeout=T)) < TOL


def test_conv2d_three_ranks_empty_tile():
    assert max(run_distributed(_conv2d, 3, "zeros", [8, 0, 9], timeout=T)) < TOL


def test_conv1d_and_conv3d():
    assert max(run_distributed(_conv1d, 3, [5, 2, 10], timeout=T)) < TOL
    assert max(run_distributed(_conv3d, 2, [4, 5], timeout=T)) < TOL


@pytest.mark.slow
def test_conv1d_and_conv3d_four_ranks():
    assert max(run_distributed(_conv1d, 4, [1, 8, 0, 8], timeout=T)) < TOL
    assert max(run_distributed(_conv3d, 4, [3, 1, 2, 3], timeout=T)) < TOL


def test_unknown_layers_are_refused_by_name_before_anything_changes():
    model = nn.Sequential(nn.Conv2d(1, 1, 3), nn.LSTM(2, 2), nn.Sequential(nn.RNN(2, 2)))
    forward = model[0].forward
    with pytest.raises(ValueError, match=r"(?s)2 layer\(s\).*1 \(LSTM\).*2\.0 \(RNN\)") as info:
        parallelize_domain(model, dims=-2)
    assert "RNN" in str(info.value)
    assert model[0].forward == forward and "_tensorpar_domain" not in vars(model)


def test_refusals_of_unsupported_settings():
    with pytest.raises(ValueError, match="return_indices"):
        parallelize_domain(nn.MaxPool2d(2, return_indices=True), dims=-1)
    with pytest.raises(ValueError, match="output_size"):
        parallelize_domain(nn.AdaptiveAvgPool2d(3), dims=-1)
    with pytest.raises(ValueError, match="bicubic"):
        parallelize_domain(nn.Upsample(scale_factor=2, mode="bicubic"), dims=-1)
    with pytest.raises(TypeError, match="dims"):
        parallelize_domain(nn.Conv2d(1, 1, 1), dims=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="DeviceMesh"):
        parallelize_domain(nn.Conv2d(1, 1, 1), dims=(-1, -2))
    net = parallelize_domain(nn.Conv2d(1, 1, 1), dims=-1)
    with pytest.raises(ValueError, match="already"):
        parallelize_domain(net, dims=-1)


def test_names_and_state_dict_are_the_dense_models():
    dense = conv2d_stack("zeros")()
    names = [n for n, _ in dense.named_parameters()]
    state = {k: v.clone() for k, v in dense.state_dict().items()}
    par = parallelize_domain(dense, dims=-2)
    assert [n for n, _ in par.named_parameters()] == names
    assert all(torch.equal(state[k], v) for k, v in par.state_dict().items())
