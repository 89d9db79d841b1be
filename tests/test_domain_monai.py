"""MONAI's segmentation and classification networks, unmodified, domain-parallel at 2 ranks
(split along H, uneven tiles) against dense: output, every parameter gradient and the input
tile's gradient, float64. Dropout is set to 0 (its masks would differ from dense's)."""

import warnings

import pytest
import torch
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
T = 600


def _nets():
    import monai.networks.nets as N
    return {
        "SegResNet": lambda: N.SegResNet(spatial_dims=2, init_filters=4, in_channels=1,
                                         out_channels=2, blocks_down=(1, 1, 1),
                                         blocks_up=(1, 1), norm=("GROUP", {"num_groups": 2})),
        "DynUNet": lambda: N.DynUNet(spatial_dims=2, in_channels=1, out_channels=2,
                                     kernel_size=[3, 3, 3], strides=[1, 2, 2],
                                     upsample_kernel_size=[2, 2], filters=[4, 8, 8]),
        "AttentionUnet": lambda: N.AttentionUnet(spatial_dims=2, in_channels=1, out_channels=2,
                                                 channels=(4, 8, 16), strides=(2, 2)),
        "VNet": lambda: N.VNet(spatial_dims=2, in_channels=1, out_channels=2),
        "HighResNet": lambda: N.HighResNet(spatial_dims=2, in_channels=1, out_channels=2),
        "BasicUNetPlusPlus": lambda: N.BasicUNetPlusPlus(spatial_dims=2, in_channels=1,
                                                         out_channels=2,
                                                         features=(4, 4, 8, 8, 16, 4)),
        "MedNeXt": lambda: N.MedNeXt(spatial_dims=2, in_channels=1, out_channels=2,
                                     init_filters=4, blocks_down=(1, 1), blocks_bottleneck=1,
                                     blocks_up=(1, 1)),
        "FlexibleUNet": lambda: N.FlexibleUNet(in_channels=1, out_channels=2,
                                               backbone="efficientnet-b0", spatial_dims=2,
                                               pretrained=False),
        "DenseNet": lambda: N.DenseNet(spatial_dims=2, in_channels=1, out_channels=3,
                                       init_features=8, growth_rate=4, block_config=(2, 2)),
        "ResNet": lambda: N.ResNet(block="basic", layers=(1, 1, 1, 1),
                                   block_inplanes=(4, 8, 8, 8), spatial_dims=2,
                                   n_input_channels=1, num_classes=3),
    }


CLASSIFIERS = {"DenseNet", "ResNet"}


class _First(nn.Module):
    """The first output of a network that returns a list (BasicUNetPlusPlus)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out[0] if isinstance(out, (list, tuple)) else out


def _without_dropout(build):
    def built() -> nn.Module:
        model = build()
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
            if hasattr(m, "drop_connect_rate"):  # EfficientNet's blocks
                m.drop_connect_rate = 0.0
        return _First(model)
    return built


def _run(name):
    warnings.filterwarnings("ignore")
    # relative to each tensor's magnitude above 1 (FlexibleUNet's gradients reach 4e3)
    return check(_without_dropout(_nets()[name]), (2, 1, 32, 32), (-2,), ([17, 15],),
                 replicated=name in CLASSIFIERS, relative=True)


@pytest.mark.parametrize("name", ["SegResNet", "DynUNet", "AttentionUnet", "VNet",
                                  "HighResNet", "BasicUNetPlusPlus", "MedNeXt",
                                  "FlexibleUNet", "DenseNet", "ResNet"])
def test_monai_network_equals_dense(name):
    pytest.importorskip("monai")
    assert max(run_distributed(_run, 2, name, timeout=T)) < 1e-10


def _resized_to_input(name):
    warnings.filterwarnings("ignore")
    import monai.networks.nets as N
    build = {"RegUNet": lambda: N.RegUNet(spatial_dims=2, in_channels=1, num_channel_initial=4,
                                          depth=2, out_channels=2),
             "LocalNet": lambda: N.LocalNet(spatial_dims=2, in_channels=1,
                                            num_channel_initial=4, extract_levels=(0, 1, 2),
                                            out_channels=2)}[name]
    # tiles of a multiple of 4 rows (the networks check that each level's size is even)
    return check(_without_dropout(build), (2, 1, 32, 32), (-2,), ([20, 12],), steps=1,
                 relative=True)


@pytest.mark.parametrize("name", ["RegUNet", "LocalNet"])
def test_monai_networks_resizing_to_the_inputs_shape_equal_dense(name):
    # F.interpolate(..., size=x.shape[2:]) in their forward asks for the tile's size
    pytest.importorskip("monai")
    assert max(run_distributed(_resized_to_input, 2, name, timeout=T)) < 1e-10


def _pixelshuffle_unet(dims):
    warnings.filterwarnings("ignore")
    import monai.networks.nets as N

    def build():
        return N.BasicUNet(spatial_dims=dims, in_channels=1, out_channels=2,
                           features=(4, 4, 4, 4, 4, 4), upsample="pixelshuffle")
    shape = (1, 1, 32, 16) if dims == 2 else (1, 1, 32, 16, 16)
    return check(build, shape, (-dims,), ([14, 18],), steps=1, relative=True)


@pytest.mark.parametrize("dims", [2, 3])
def test_basic_unet_with_pixel_shuffle_up_sampling_equals_dense(dims):
    # uneven tiles: each level's shuffle fetches the rows of the split recorded for its length
    pytest.importorskip("monai")
    assert max(run_distributed(_pixelshuffle_unet, 2, dims, timeout=T)) < 1e-10
