"""Calls that work along a dim and need the whole of it (finite differences, integrals,
FFTs, similarities, triangles and diagonals, sampling grids, repeats): along a dim that
holds the split points they raise on every rank; along other dims they run and equal
dense. On strips and on a 2 x 2 mesh."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check_or_error

pytestmark = pytest.mark.timeout(300)
T = 240
TOL = 1e-10

CALLS = {
    "gradient_h": lambda x: torch.gradient(x, dim=-2)[0],
    "gradient_all": lambda x: torch.gradient(x)[0],
    "gradient_spacing": lambda x: torch.gradient(x, spacing=2.0, dim=(-2, -1))[0],
    "fft2": lambda x: torch.fft.fft2(x).real,
    "rfft_h": lambda x: torch.fft.rfft(x, dim=-2).abs(),
    "fftn": lambda x: torch.fft.fftn(x).imag,
    "fftshift": lambda x: torch.fft.fftshift(x),
    "trapezoid": lambda x: torch.trapezoid(x, dim=-2),
    "cumulative_trapezoid": lambda x: torch.cumulative_trapezoid(x, dim=-2),
    "cosine": lambda x: F.cosine_similarity(x, 2 * x + 1, dim=-2),
    "pairwise": lambda x: F.pairwise_distance(x.transpose(-2, -1), 2 * x.transpose(-2, -1)),
    "tril": lambda x: torch.tril(x),
    "triu": lambda x: x.triu(1),
    "diagonal": lambda x: torch.diagonal(x, dim1=-2, dim2=-1),
    "repeat": lambda x: x.repeat(1, 1, 2, 1),
    "tile": lambda x: torch.tile(x, (2, 1)),
    "grid_sample": lambda x: F.grid_sample(
        x, torch.zeros(x.shape[0], 3, 3, 2, dtype=x.dtype), align_corners=False),
}
ALONG_OTHERS = {  # the same calls along the channels (or the batch): as they are
    "gradient_c": lambda x: torch.gradient(x, dim=1)[0],
    "fft_c": lambda x: torch.fft.fft(x, dim=1).real,
    "cosine_c": lambda x: F.cosine_similarity(x, 2 * x + 1, dim=1),
    "repeat_b": lambda x: x.repeat(2, 1, 1, 1),
    "trapezoid_c": lambda x: torch.trapezoid(x, dim=1),
}


class Along(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = {**CALLS, **ALONG_OTHERS}[self.name](self.conv(x))
        return y if y.dim() == 4 else y.unsqueeze(1)


def _build(name):
    return Along(name)


def _run(name, hs, ws, mesh):
    return check_or_error(functools.partial(_build, name), hs, ws, mesh)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_along_a_split_dim_raises_on_every_rank(name):
    for world, hs, ws, mesh in ((2, [3, 5], [8], None), (4, [4, 4], [4, 4], (2, 2))):
        out = run_distributed(_run, world, name, hs, ws, mesh, timeout=T)
        assert all(isinstance(o, str) and "domain-parallel" in o for o in out), (world, out)


@pytest.mark.parametrize("name", sorted(ALONG_OTHERS))
def test_along_other_dims_equals_dense(name):
    for world, hs, ws, mesh in ((2, [3, 5], [8], None), (4, [3, 4], [5, 2], (2, 2))):
        out = run_distributed(_run, world, name, hs, ws, mesh, timeout=T)
        assert all(not isinstance(o, str) and o < TOL for o in out), (world, out)
