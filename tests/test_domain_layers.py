"""parallelize_domain on the other layer kinds: norms (statistics over the whole domain,
running statistics), max/avg pooling with padding and ceil mode, global pooling with a
replicated head, up-sampling (nearest, bilinear, trilinear, both align_corners),
``F.interpolate`` inside a forward, transposed convolutions; odd sizes, narrow and empty
tiles, at 2 and 3 ranks (float64, within 1e-10 of dense)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


class Interp(nn.Module):
    """A block that resizes with a functional call inside its forward (diffusers style)."""

    def __init__(self, mode, **kw):
        super().__init__()
        self.mode, self.kw = mode, kw
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, mode=self.mode, **self.kw))


class Pad(nn.Module):
    """A layer, then ``F.pad`` inside the same forward."""

    def __init__(self, layer, pads, **kw):
        super().__init__()
        self.layer, self.pads, self.kw = layer, pads, kw

    def forward(self, x):
        return F.pad(self.layer(x), self.pads, **self.kw)


def padding():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ZeroPad2d((1, 2, 3, 1)),
                         Pad(nn.Conv2d(3, 3, 3), (2, 0, 0, 2), value=0.5),  # no padding:
                         nn.Conv2d(3, 3, (3, 1), padding=(1, 0)),           # the pads' rows
                         nn.ConstantPad2d((0, 1, 2, 2), -1.0), nn.MaxPool2d(2, ceil_mode=True),
                         Pad(nn.Conv2d(3, 3, 3, padding=1), (1, 1, 2, 1), mode="reflect"),
                         Pad(nn.Conv2d(3, 3, 3), (0, 0, 1, 3), mode="replicate"),
                         Pad(nn.Conv2d(3, 3, 3), (1, 0, 2, 1), mode="circular"),
                         nn.ReflectionPad2d((0, 1, 1, 2)), nn.Conv2d(3, 3, 3),
                         nn.ReplicationPad2d(1), nn.CircularPad2d((1, 1, 0, 1)),
                         nn.Conv2d(3, 2, 3, padding=1))


def norms():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True),
                         nn.BatchNorm2d(4, momentum=None), nn.LayerNorm([4, 17, 6]))


def pools():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1),
                         nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
                         nn.MaxPool2d(2, ceil_mode=True),
                         nn.AvgPool2d(2, stride=2, padding=1, ceil_mode=True),
                         nn.AvgPool2d(3, stride=1, padding=1, divisor_override=5))


def resample():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Upsample(scale_factor=2),
                         nn.Upsample(scale_factor=0.5, mode="bilinear"),
                         nn.Upsample(size=(23, 9), mode="bilinear", align_corners=True),
                         Interp("nearest", scale_factor=1.5),
                         Interp("bilinear", size=(12, 7), align_corners=False),
                         nn.Upsample(scale_factor=(2, 1), mode="nearest-exact"))


def transposed():
    return nn.Sequential(nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
                         nn.ConvTranspose2d(3, 3, 2, stride=2),
                         nn.ConvTranspose2d(3, 2, 1, stride=3, bias=True),
                         nn.ConvTranspose2d(2, 2, (4, 3), stride=(2, 1), padding=1, dilation=2,
                                            groups=2))


def head():
    return nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.GELU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def volume():
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2),
                         nn.MaxPool3d(2), nn.Upsample(scale_factor=2, mode="trilinear"),
                         nn.ConvTranspose3d(2, 1, 2, stride=2), nn.GroupNorm(1, 1))


def line():
    return nn.Sequential(nn.Conv1d(1, 2, 3, padding=1), nn.InstanceNorm1d(2),
                         nn.AvgPool1d(3, stride=2, padding=1),
                         nn.Upsample(scale_factor=3, mode="linear", align_corners=True))


def unbatched():
    """An image with no batch dim: ``(C, H, W)``, which only the instance norm accepts."""
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True),
                         nn.SiLU(), nn.Conv2d(4, 3, 3, padding=1), nn.InstanceNorm2d(3),
                         nn.Conv2d(3, 2, 3, padding=1))


BUILDERS = {"norms": norms, "pools": pools, "resample": resample, "transposed": transposed,
            "head": head, "volume": volume, "line": line, "padding": padding,
            "unbatched": unbatched}
SHAPES = {"volume": (2, 1, None, 4, 4), "line": (2, 1, None), "unbatched": (2, None, 5)}
DIMS = {"volume": -3, "line": -1}


def _run(name, sizes, steps=0):
    shape = list(SHAPES.get(name, (2, 2, None, 6)))
    shape[shape.index(None)] = sum(sizes)
    return check(BUILDERS[name], shape, (DIMS.get(name, -2),), (sizes,), steps=steps,
                 replicated=name == "head")


@pytest.mark.parametrize("name", ["norms", "pools", "resample", "transposed", "head",
                                  "padding"])
def test_layers_two_ranks(name):
    assert max(run_distributed(_run, 2, name, [9, 8], timeout=T)) < TOL


@pytest.mark.parametrize("name", ["norms", "pools", "resample", "transposed", "head",
                                  "padding"])
def test_layers_three_ranks_narrow_tile(name):
    assert max(run_distributed(_run, 3, name, [5, 1, 11], timeout=T)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["norms", "pools", "resample", "transposed", "head",
                                  "padding"])
def test_layers_three_ranks_empty_tile(name):
    assert max(run_distributed(_run, 3, name, [7, 0, 10], timeout=T)) < TOL


def test_norms_running_statistics_over_three_steps():
    # 1e-9: the GroupNorm bias's gradient is zero in exact arithmetic (the InstanceNorm
    # after it takes each channel's mean out), so both sides hold the rounding left from
    # cancelling gradients of about 40; it reaches 1.8e-10 at the third step on some CPUs
    assert max(run_distributed(_run, 3, "norms", [6, 6, 5], 3, timeout=T)) < 1e-9


@pytest.mark.parametrize("world,sizes", [(2, [5, 3]), (3, [3, 1, 4])])
def test_volume_and_line(world, sizes):
    assert max(run_distributed(_run, world, "volume", sizes, timeout=T)) < TOL
    assert max(run_distributed(_run, world, "line", [s + 2 for s in sizes], timeout=T)) < TOL


def test_an_unbatched_image_through_instance_norms_equals_dense():
    # (each rank took its tile's rows for channels: tiles of unequal height made the
    # ranks' statistics exchanges of different sizes, which the backend reported as a
    # collective mismatch)
    assert max(run_distributed(_run, 2, "unbatched", [6, 7], 3, timeout=T)) < TOL
    assert max(run_distributed(_run, 3, "unbatched", [1, 9, 6], 3, timeout=T)) < TOL


@pytest.mark.slow
def test_layers_four_ranks():
    for name in BUILDERS:
        sizes = [2, 8, 0, 6] if name in ("volume", "line") else [4, 4, 1, 8]
        assert max(run_distributed(_run, 4, name, sizes, timeout=T)) < TOL, name


def _pad_refusals():
    from tensorpar.nn import parallelize_domain

    for pads in [(0, 0, -1, 0), (0, 0, 2, -1)]:
        net = parallelize_domain(Pad(nn.Conv2d(1, 1, 3, padding=1), pads), dims=-2)
        with pytest.raises(ValueError, match="negative pad crops"):
            net(torch.ones(1, 1, 4, 5))
    # padding only the dim that is not split runs as it is
    net = parallelize_domain(Pad(nn.Identity(), (1, 1, 0, 0), mode="reflect"), dims=-2)
    return tuple(net(torch.ones(1, 1, 4, 5)).shape)


def test_pad_refuses_a_crop_along_a_split_dim():
    assert run_distributed(_pad_refusals, 2, timeout=T) == [(1, 1, 4, 7)] * 2


class _Tied(nn.Module):
    """One weight shared by two convolutions; the one registered first may not run."""

    def __init__(self, both: bool) -> None:
        super().__init__()
        self.both = both
        self.first, self.second = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) if self.both else x)


def _tied(both, sizes):
    return check(lambda: _Tied(both), (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("both", [True, False])
def test_tied_weights(both):
    assert max(run_distributed(_tied, 3, both, [4, 0, 5], timeout=T)) < 1e-10


def _unbatched_in_validation_mode():
    with tp.validation(True):
        return _run("unbatched", [1, 9, 6])


def test_validation_mode_takes_an_unbatched_tile_on_either_convolution_path():
    """The 1-row tile's convolution exchanges its rows unbatched, the others' overlapped
    path with a batch dim of 1: the same rows, which validation mode called a mismatch."""
    assert max(run_distributed(_unbatched_in_validation_mode, 3, timeout=T)) < TOL


def _parameter_grads(sizes, create_graph):
    import copy

    import torch.distributed as dist

    from tensorpar.nn import domain_mean, parallelize_domain

    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                          nn.Conv2d(3, 1, 3, padding=1)).double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2, double_backward=create_graph)
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(dense(x).square().mean(), list(dense.parameters()))
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank])
    got = torch.autograd.grad(domain_mean(par(tile).square()), list(par.parameters()),
                              create_graph=create_graph)
    assert all(p.grad is None for p in par.parameters())  # autograd.grad leaves .grad alone
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        total = g.detach().clone()
        dist.all_reduce(total)  # the partial gradients sum to the dense one
        worst = max(worst, (total - w).abs().max().item())
    # and backward() afterwards still sums over the domain into .grad
    domain_mean(par(tile).square()).backward()
    for p, w in zip(par.parameters(), want, strict=True):
        worst = max(worst, (p.grad - w).abs().max().item())
    return worst


@pytest.mark.parametrize("create_graph", [False, True])
def test_autograd_grad_of_the_parameters_gives_this_rank_s_partial_gradient(create_graph):
    # before: zeros came back, and the sums went into .grad behind the call's back
    assert max(run_distributed(_parameter_grads, 3, [5, 0, 4], create_graph, timeout=T)) < TOL
