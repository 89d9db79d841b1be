"""Real models, unmodified, domain-parallel against dense (float64, within 1e-10): MONAI's
UNet and BasicUNet (3-D, split along D), diffusers' UNet2DModel without attention (GroupNorm,
strided down-sampling, ``F.interpolate`` up-sampling, a timestep input), at 2 and 3 ranks;
MONAI's EfficientNet and SENet (squeeze-and-excitation in every block, a classifier head)."""

import warnings

import pytest
import torch

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


def monai_unet():
    from monai.networks.nets import UNet
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16),
                strides=(2, 2), num_res_units=1)


def monai_basic_unet():
    from monai.networks.nets import BasicUNet
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2,
                     features=(4, 4, 8, 8, 16, 4))


def diffusers_unet():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=16, in_channels=2, out_channels=2, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D",) * 2,
                       up_block_types=("UpBlock2D",) * 2, add_attention=False,
                       norm_num_groups=4)


def _timestep():
    return (torch.tensor([3, 7]),)


MODELS = {"monai_unet": (monai_unet, (1, 1, None, 12, 12), -3, None),
          "monai_basic_unet": (monai_basic_unet, (1, 1, None, 16, 16), -3, None),
          "diffusers_unet": (diffusers_unet, (2, 2, None, 16), -2, _timestep)}


def _run(name, sizes):
    warnings.filterwarnings("ignore")
    build, shape, dim, extra = MODELS[name]
    shape = list(shape)
    shape[shape.index(None)] = sum(sizes)
    return check(build, shape, (dim,), (sizes,), extra=extra)


SIZES = {"monai_unet": ([9, 7], [6, 5, 5]), "monai_basic_unet": ([17, 15], [11, 11, 10]),
         "diffusers_unet": ([9, 7], [5, 6, 5])}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_two_ranks(name):
    pytest.importorskip(name.split("_")[0])
    assert max(run_distributed(_run, 2, name, SIZES[name][0], timeout=T)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_model_three_ranks(name):
    pytest.importorskip(name.split("_")[0])
    assert max(run_distributed(_run, 3, name, SIZES[name][1], timeout=T)) < TOL


def monai_efficientnet():
    from monai.networks.nets import EfficientNet
    blocks = ["r1_k3_s11_e1_i32_o16_se0.25", "r2_k3_s22_e6_i16_o24_se0.25",
              "r2_k5_s22_e6_i24_o40_se0.25", "r1_k3_s11_e6_i40_o80_se0.25"]
    # (no dropout or drop-connect: random masks would differ from dense's)
    return EfficientNet(blocks, spatial_dims=2, in_channels=1, num_classes=3,
                        width_coefficient=0.5, dropout_rate=0.0, drop_connect_rate=0.0,
                        image_size=32)


def monai_senet():
    from monai.networks.nets import SENet
    return SENet(spatial_dims=2, in_channels=1, block="se_resnet_bottleneck",
                 layers=(1, 1, 1, 1), groups=1, reduction=4, inplanes=8,
                 downsample_kernel_size=1, input_3x3=False, num_classes=3, dropout_prob=None)


def _classifier(name, sizes):
    warnings.filterwarnings("ignore")
    if name == "efficientnet":  # 2 SGD steps; TensorFlow's "same" padding as F.pad layers
        return check(monai_efficientnet, (2, 1, sum(sizes), 32), (-2,), (sizes,), steps=2,
                     replicated=True, lr=0.01)
    # SENet's BatchNorm gradients reach 50: compared relative to each tensor's magnitude
    return check(monai_senet, (2, 1, sum(sizes), 24), (-2,), (sizes,), replicated=True,
                 relative=True)


def test_squeeze_excitation_classifier_two_ranks():
    pytest.importorskip("monai")
    assert max(run_distributed(_classifier, 2, "efficientnet", [17, 15], timeout=T)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name, sizes", [("efficientnet", [12, 0, 20]),
                                         ("senet", [11, 10, 11])])
def test_squeeze_excitation_classifier_three_ranks(name, sizes):
    pytest.importorskip("monai")
    assert max(run_distributed(_classifier, 3, name, sizes, timeout=T)) < TOL
