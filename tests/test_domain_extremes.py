"""The largest and smallest values over a split domain: ``amax``/``amin`` over every split
point and ``max()``/``min()`` of a whole tile (the gradient shared evenly by every point
equal to it, anywhere in the domain, as torch's), and global max pooling
(``AdaptiveMaxPool1d/2d/3d`` and ``F.adaptive_max_pool1d/2d/3d`` to size 1: the gradient
to the first such point in the domain's row-major order), equal to dense, also where many
points tie across the ranks."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed
from tests import test_domain_reductions as reductions
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300
Head = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Reduced(reductions.Reduced):
    """A convolution, then ``head(self, features)``; with a global max pooling to call."""

    def __init__(self, head: Head) -> None:
        super().__init__(head)
        self.pool = nn.AdaptiveMaxPool2d(1)


def _dead(y: torch.Tensor) -> torch.Tensor:
    """Every point of channel 0 zero, with the gradient passing to each: a tie over the
    whole domain whose gradient counts (a dead ReLU's would be zero anyway)."""
    return torch.cat([y[:, :1] - y[:, :1].detach(), y[:, 1:]], 1)


CASES: dict[str, Head] = {
    "amax over the image's dims": lambda m, y: m.fc(y.amax((2, 3))),
    "amin given axis=": lambda m, y: m.fc(y.amin(axis=(2, 3))),
    "amax in steps": lambda m, y: m.fc(y.amax(-1).amax(-1)),
    "amax over tokens": lambda m, y: m.fc(y.flatten(2).amax(-1)),
    "a tile over its largest magnitude": lambda m, y: m.fc(
        (y / y.abs().amax()).mean((2, 3))),
    "max of the whole tile": lambda m, y: m.fc(y.mean((2, 3))) * y.max(),
    "min of the whole tile": lambda m, y: m.fc(y.mean((2, 3))) - y.min(),
    "amax with every point tied": lambda m, y: m.fc(_dead(y).amax((2, 3))),
    "max pooling layer": lambda m, y: m.fc(m.pool(y).flatten(1)),
    "max pooling call": lambda m, y: m.fc(F.adaptive_max_pool2d(y, 1).flatten(1)),
    "max pooling with every point tied": lambda m, y: m.fc(m.pool(_dead(y)).flatten(1)),
    "max pooling, keyword size": lambda m, y: m.fc(
        F.adaptive_max_pool2d(y, output_size=(1, 1)).flatten(1)),
}


def _strips(case, sizes):
    return check(lambda: Reduced(CASES[case]), (2, 2, sum(sizes), 5), (-2,), (sizes,),
                 steps=2, replicated=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_domains_largest_and_smallest_equal_dense(case):
    assert max(run_distributed(_strips, 2, case, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_strips, 3, case, [0, 4, 8], timeout=T)) < 1e-10
    assert max(run_distributed(_strips, 2, case, [1, 11], timeout=T)) < 1e-10


def _mesh(case):
    return check(lambda: Reduced(CASES[case]), (1, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                 mesh_shape=(2, 2), replicated=True)


@pytest.mark.parametrize("case", ["amax over the image's dims", "max pooling layer",
                                  "max pooling with every point tied",
                                  "amax with every point tied"])
def test_over_a_mesh_of_tiles(case):
    assert max(run_distributed(_mesh, 4, case, timeout=T)) < 1e-10


def _first_of_two(build: str):
    """Two equal maxima: at (0, 5), on rank 1's tile, and at (1, 0), on rank 0's; the
    domain's row-major order puts (0, 5) first, rank order the other."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.zeros(1, 1, 6, 7, dtype=torch.float64)
    x[0, 0, 0, 5] = x[0, 0, 1, 0] = 1.0
    dense = POOLS[build]().double()
    par = parallelize_domain(POOLS[build]().double(), dims=(-2, -1), group=mesh)
    xd = x.clone().requires_grad_(True)
    dense(xd).sum().backward()
    r, c = mesh.get_coordinate()
    rows, cols = ([0, 2], [2, 4])[r], ([0, 4], [4, 3])[c]
    tile = x[:, :, rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]].clone()
    tile.requires_grad_(True)
    out = par(tile)
    out.sum().backward()
    want = xd.grad[:, :, rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]]
    return float((out - dense(x)).abs().max()), torch.equal(tile.grad, want)


POOLS = {"layer": lambda: nn.AdaptiveMaxPool2d(1),
         "in a container": lambda: nn.Sequential(nn.Identity(), nn.AdaptiveMaxPool2d((1, 1)))}


@pytest.mark.parametrize("build", sorted(POOLS))
def test_a_tie_goes_to_the_first_point_in_the_domains_order(build):
    for err, same in run_distributed(_first_of_two, 4, build, timeout=T):
        assert err == 0.0 and same


class Volume(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv3d(1, 3, 3, padding=1), nn.AdaptiveMaxPool3d(1)
        self.functional = functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x) - 0.5)  # (some channels tie at 0 over many points)
        return (F.adaptive_max_pool3d(y, 1) if self.functional else self.pool(y)).flatten(1)


def _volume(functional, sizes):
    return check(lambda: Volume(functional), (2, 1, sum(sizes), 4, 3), (-3,), (sizes,),
                 steps=2, replicated=True)


@pytest.mark.parametrize("functional", [False, True], ids=["layer", "call"])
def test_a_volume_s_global_max_pooling_equals_dense(functional):
    assert max(run_distributed(_volume, 3, functional, [3, 0, 4], timeout=T)) < 1e-10


class Signal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv1d(2, 3, 5, padding=2), nn.AdaptiveMaxPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.tanh(self.conv(x))).flatten(1)


def _signal(sizes):
    return check(Signal, (2, 2, sum(sizes)), (-1,), (sizes,), steps=2, replicated=True)


def test_a_signal_s_global_max_pooling_equals_dense():
    assert max(run_distributed(_signal, 2, [6, 9], timeout=T)) < 1e-10


REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "indices of a pooling layer": (lambda: nn.Sequential(
        nn.Conv2d(2, 2, 1), nn.AdaptiveMaxPool2d(1, return_indices=True)), "return_indices"),
    "a pooling layer to size 2": (lambda: nn.Sequential(
        nn.Conv2d(2, 2, 1), nn.AdaptiveMaxPool2d(2)), "output_size"),
    "indices of a pooling call": (lambda: Reduced(
        lambda m, y: F.adaptive_max_pool2d(y, 1, return_indices=True)[0]), "indices"),
    "a pooling call to size 2": (lambda: Reduced(
        lambda m, y: F.adaptive_max_pool2d(y, 2)), "output size 1"),
    "max along rows, with indices": (lambda: Reduced(
        lambda m, y: m.fc(y.flatten(2).max(-1).values)), "points"),
}


def _refused(case, sizes):
    build, match = REFUSED[case]
    try:
        model = parallelize_domain(build().double(), dims=-2)
        model(torch.randn(2, 2, sizes[torch.distributed.get_rank()], 5, dtype=torch.float64))
    except ValueError as e:
        return match in str(e)
    return False


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_indices_and_other_sizes_are_refused_on_every_rank(case):
    assert all(run_distributed(_refused, 3, case, [4, 0, 8], timeout=T))


class Untrained(nn.Module):
    """A reduction of the input itself (integers, flags, NaN: no gradient needed)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 1, 1), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


VALUES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "integers": lambda y: (y * 4).long().amax((2, 3)),
    "integer min": lambda y: (y * 4).long().amin((2, 3)),
    "flags": lambda y: (y > 2.5).amax((2, 3)),
    "no flag set": lambda y: (y > 50).max(),
    "a NaN": lambda y: torch.where(y == y.amax(), float("nan"), y).amax((2, 3)),
    "a NaN pooled": lambda y: F.adaptive_max_pool2d(
        torch.where(y == y.amin(), float("nan"), y), 1),  # (the NaN is not the largest)
}


def _values(case, sizes):
    import torch.distributed as dist

    torch.manual_seed(0)
    dense = Untrained(VALUES[case]).double()
    par = parallelize_domain(Untrained(VALUES[case]).double(), dims=-2)
    par.load_state_dict(dense.state_dict())
    x = torch.randn(1, 1, sum(sizes), 3, dtype=torch.float64)
    rank = dist.get_rank()
    with torch.no_grad():
        want = dense(x)
        got = par(x.narrow(-2, sum(sizes[:rank]), sizes[rank]))
    return got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()) and \
        torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("case", sorted(VALUES))
def test_integers_flags_and_nans_equal_dense_an_empty_tile_too(case):
    # (an empty tile's fill was -inf: an integer tile raised alone, a flag read True; a
    # NaN on a rank other than the first was dropped by the all-reduce)
    for sizes in ([0, 5], [2, 3], [5, 0], [2, 0, 3]):
        assert all(run_distributed(_values, len(sizes), case, sizes, timeout=T)), sizes


def _double_backward(case):
    import torch.distributed as dist

    model = parallelize_domain(Reduced(CASES[case]).double(), dims=-2)
    sizes = [0, 5]
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    tile = x.narrow(-2, sum(sizes[:dist.get_rank()]), sizes[dist.get_rank()])
    tile.requires_grad_(True)
    out = model(tile)
    try:
        (g,) = torch.autograd.grad(out.sum(), tile, create_graph=True)
        torch.autograd.grad((g**2).sum(), tile, allow_unused=True)
    except RuntimeError as e:
        return "differentiable once" in str(e)
    return False


@pytest.mark.parametrize("case", ["a tile over its largest magnitude", "max pooling layer"])
def test_a_second_derivative_raises_on_every_rank(case):
    assert all(run_distributed(_double_backward, 2, case, timeout=T))
