"""Reductions of a tile inside a converted model's forward: a sum or mean over every split
point is the domain's (also in steps, after a reshape, over the whole tile; the largest
and smallest values: `test_domain_extremes.py`); any other reduction along a split point,
and an ``einsum`` that pairs two tiles' points, raises on every rank (products summing
over every point: `test_domain_contractions.py`),
also with an empty tile; reductions along other dims are followed, so a later one along
the points is still seen."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300
Head = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Reduced(nn.Module):
    """A convolution, then ``head(self, features)``: the reduction under test."""

    def __init__(self, head: Head) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)
        self.mix = nn.Parameter(torch.randn(4, 4) / 2)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self, self.conv(x))


CONVERTED: dict[str, Head] = {
    "sum over the image's dims": lambda m, y: m.fc(y.sum((2, 3))),
    "mean in steps": lambda m, y: m.fc(y.mean(-1).mean(-1)),
    "std along the rows, then mean": lambda m, y: m.fc(y.std(-1).mean(-1)),
    "sum then mean": lambda m, y: m.fc(y.sum(2, keepdim=True).mean(-1).squeeze(-1)),
    "mean over tokens": lambda m, y: m.fc(y.flatten(2).mean(-1)),
    "sum over tokens, channels last": lambda m, y: m.fc(y.flatten(2).transpose(1, 2).sum(1)),
    "mean of the whole tile": lambda m, y: m.fc(y.square().transpose(1, 3)).mean(),
    "einsum over channels, then mean in steps":
        lambda m, y: m.fc(torch.einsum("bchw,dc->bdhw", y, m.mix).mean(-1).mean(-1)),
    "einsum of two tiles, point by point":
        lambda m, y: torch.einsum("bchw,bdhw->bcdhw", y, y).sum((1, 2)),
    "mean given axis=": lambda m, y: m.fc(y.mean(axis=(2, 3))),
    "channel mean given axis=": lambda m, y: y * y.mean(axis=1, keepdims=True),
    "channel amax given axis=": lambda m, y: y.amax(axis=1, keepdim=True) * y,
    "elementwise max given other=": lambda m, y: torch.max(y, other=y.flip(1)),
    "a same-rank view, then a mean": lambda m, y: m.fc(
        y.reshape(y.shape[0], 1, 4, -1).mean(-1).squeeze(1)),
    "stacked, then a mean": lambda m, y: m.fc(torch.stack([y, 2 * y], 1).mean((-2, -1))[:, 1]),
    "a channel picked, then a mean": lambda m, y: m.fc(y[:, 0:1].expand_as(y).mean((-2, -1))),
    "a channel indexed, then a mean": lambda m, y: m.fc(y[:, :, None].mean((-2, -1))[:, :, 0]),
    "channels picked by an index tensor, then a mean": lambda m, y: m.fc(
        y[:, torch.tensor([[0, 1], [2, 3]])].mean((3, 4)).flatten(1)),
    "channels picked by a list, then a mean": lambda m, y: m.fc(
        y[:, [3, 2, 1, 0], None].mean((3, 4))[:, :, 0]),
    "einsum over channels with its operands as a list, then a mean": lambda m, y: m.fc(
        torch.einsum("bchw,dc->bdhw", [y, m.mix]).mean((2, 3))),
    "tensordot over channels, then a mean": lambda m, y: m.fc(
        torch.tensordot(y, m.mix, dims=([1], [0])).mean((1, 2))),
    "einsum with an ellipsis over channels, then a mean": lambda m, y: m.fc(
        torch.einsum("bc...,dc->bd...", y, m.mix).flatten(2).mean(-1)),
    "einsum with an ellipsis, point by point": lambda m, y: m.fc(
        torch.einsum("...hw,...hw->...hw", y, y).mean((-2, -1))),
    "a dim of size 1 before the rows, then a mean": lambda m, y: m.fc(
        y.view(*y.shape[:2], 1, *y.shape[2:]).mean((2, 3, 4))),
}
"""Each equals dense: the output pooled (whole on every rank) or still a tile."""


_TILES_OUT = ("einsum of two tiles, point by point", "channel mean given axis=",
              "channel amax given axis=", "elementwise max given other=")


def _converted(case, sizes):
    pooled = case not in _TILES_OUT
    return check(lambda: Reduced(CONVERTED[case]), (2, 2, sum(sizes), 5), (-2,), (sizes,),
                 steps=2, replicated=pooled)


@pytest.mark.parametrize("case", sorted(CONVERTED))
def test_sums_and_means_over_every_point_equal_dense(case):
    assert max(run_distributed(_converted, 2, case, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_converted, 3, case, [4, 0, 8], timeout=T)) < 1e-10
    # a one-row tile: a reshape's points read from its sizes, every rank's verdict
    assert max(run_distributed(_converted, 2, case, [1, 11], timeout=T)) < 1e-10


REFUSED: dict[str, Head] = {
    "mean then std": lambda m, y: m.fc(y.mean(-1).std(-1)),
    "vector norm over the image's dims":
        lambda m, y: m.fc(torch.linalg.vector_norm(y, dim=(2, 3))),
    "normalize along rows": lambda m, y: F.normalize(y, dim=2),
    "matrix norm of each channel": lambda m, y: m.fc(torch.linalg.matrix_norm(y)),
    "linalg norm over the image's dims": lambda m, y: m.fc(torch.linalg.norm(y, dim=(2, 3))),
    "var of the whole tile, unbiased as a flag": lambda m, y: y / y.var(False),
    "norm of the whole tile": lambda m, y: y.norm(),
    "max over tokens": lambda m, y: m.fc(y.flatten(2).max(-1).values),
    "topk along rows": lambda m, y: y.topk(2, dim=2).values,
    "logsumexp in steps": lambda m, y: m.fc(y.logsumexp(-1).logsumexp(-1)),
    "einsum pairing two tiles' points": lambda m, y: torch.einsum("bchw,bdgw->bcdhg", y, y),
    "mse_loss, mean": lambda m, y: F.mse_loss(y, torch.zeros_like(y)),
    "a tile over its own sum": lambda m, y: y / y.sum(),
    "a tile times its own sum": lambda m, y: y * y.sum(),
    "a tile minus its own sum": lambda m, y: y - y.sum(),
    "a tile plus its kept-dims sum": lambda m, y: y + 0.5 * y.sum(dim=(0, 1, 2, 3), keepdim=True),
    "channels picked by an index tensor, then a softmax along rows":
        lambda m, y: y[:, torch.tensor([[0, 1], [2, 3]])].softmax(3),
    "einsum with an ellipsis pairing two tiles' points":
        lambda m, y: torch.einsum("...chw,...dgw->...cdhg", y, y),
    # (other names for the same calls, and calls along a dim they do not name)
    "softmin along rows": lambda m, y: F.softmin(y, dim=2),
    "special.softmax along rows": lambda m, y: torch.special.softmax(y, 2),
    "special.log_softmax along rows": lambda m, y: torch.special.log_softmax(y, 2),
    "special.logsumexp over the image's dims":
        lambda m, y: m.fc(torch.special.logsumexp(y, (2, 3))),
    "flipud of the rows moved first": lambda m, y: y.permute(2, 0, 1, 3).flipud(),
    "fliplr of the rows moved second": lambda m, y: torch.fliplr(y.transpose(1, 2)),
    "msort of the rows moved first": lambda m, y: torch.msort(y.transpose(0, 2)),
    "renorm of each channel": lambda m, y: torch.renorm(y, 2, 1, 1.0),
    "dist of the whole tile": lambda m, y: y / torch.dist(y, 0 * y),
    "vecdot along rows": lambda m, y: torch.linalg.vecdot(y, y, dim=2),
    "cdist between rows": lambda m, y: torch.cdist(y, y),
    "inner product along rows moved last":
        lambda m, y: torch.inner(y.transpose(2, 3), y.transpose(2, 3)),
    "lp_pool2d over rows": lambda m, y: F.lp_pool2d(y, 2, 3),
    # (products that ran on the tile, each rank's part of the dense value, silently)
    "tensordot of two tiles over rows": lambda m, y: torch.tensordot(y, y, dims=([2], [2])),
    "tensordot of a tile with a weight over rows": lambda m, y: torch.tensordot(
        y.transpose(2, 3), torch.ones(y.shape[2], 3, dtype=y.dtype), dims=1),
    "kron of a tile and a matrix": lambda m, y: torch.kron(y, torch.ones(2, 2, dtype=y.dtype)),
    "kron of a matrix and a tile": lambda m, y: torch.kron(torch.ones(2, 2, dtype=y.dtype), y),
    "trace of one image's rows": lambda m, y: y[0, 0].trace() * y,
    "cov of one image's rows": lambda m, y: torch.cov(y[0, 0]),
    "corrcoef of one image's columns": lambda m, y: torch.corrcoef(y[0, 0].T),
    "lp_pool1d over rows moved last": lambda m, y: F.lp_pool1d(y.transpose(2, 3).flatten(0, 1),
                                                                2, 2),
}
"""Each would see the tile's points alone."""


def _refused(case, sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Reduced(REFUSED[case]).double(), dims=-2)
    x = torch.randn(2, 2, sizes[torch.distributed.get_rank()], 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"points|part"):
        model(x)
    return True


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_reductions_along_the_points_are_refused(case):
    assert all(run_distributed(_refused, 2, case, [5, 7], timeout=T))
    assert all(run_distributed(_refused, 3, case, [4, 0, 8], timeout=T))


def _mesh(case):
    return check(lambda: Reduced(CONVERTED[case]), (1, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                 mesh_shape=(2, 2), replicated=True)


@pytest.mark.parametrize("case", ["sum over the image's dims", "mean over tokens",
                                  "mean of the whole tile"])
def test_over_every_point_of_a_mesh(case):
    assert max(run_distributed(_mesh, 4, case, timeout=T)) < 1e-10


def _mesh_refused():
    from torch.distributed.device_mesh import init_device_mesh

    from tensorpar.nn import parallelize_domain
    mesh = init_device_mesh("cpu", (2, 2))
    model = parallelize_domain(Reduced(lambda m, y: m.fc(y.sum(-1).sum(-1))), dims=(-2, -1),
                               group=mesh)
    with pytest.raises(ValueError, match="points"):  # the first sum is over W alone
        model(torch.randn(1, 2, 3, 4))
    return True


def test_a_sum_over_some_split_dims_of_a_mesh_is_refused():
    assert all(run_distributed(_mesh_refused, 4, timeout=T))


def _channels_last(y: torch.Tensor) -> torch.Tensor:
    """An NCHW tile as tokens ``(B, h * w, C)``, then as a channels-last image."""
    b, c, h, w = y.shape
    return y.flatten(2).transpose(1, 2).view(b, h, w, c)


def _window_attention(y: torch.Tensor) -> torch.Tensor:
    """Self-attention within windows of 2 rows by the whole width (Swin's, unshifted)."""
    b, c, h, w = y.shape
    win = y.flatten(2).transpose(1, 2).view(b, h // 2, 2 * w, c)  # (B, windows, tokens, C)
    out = (win @ win.transpose(-2, -1) / c).softmax(-1) @ win
    return out.view(b, h * w, c).transpose(1, 2).view(b, c, h, w)


SPLIT_BACK: dict[str, tuple[Head, bool]] = {
    "channels last, mean over its points": (lambda m, y: m.fc(_channels_last(y).mean((1, 2))),
                                             True),
    "channels last, mean over the rows, then the columns":
        (lambda m, y: m.fc(_channels_last(y).mean(1).mean(1)), True),
    "channels last, a linear layer, then back": (
        lambda m, y: m.fc(_channels_last(y)).permute(0, 3, 1, 2), False),
}
"""Tokens split back into an image's rows and columns: the points followed into the rows
(split along H) or the columns (split along W). Each: (head, pooled)."""

WINDOWS: dict[str, tuple[Head, bool]] = {
    "windows of 2 rows, softmax within each": (lambda m, y: (lambda w: (w.softmax(3) * w).view(
        y.shape))(y.view(y.shape[0], y.shape[1], -1, 2, y.shape[3])), False),
    "windows of 2 rows, mean over every window": (lambda m, y: m.fc(
        y.view(y.shape[0], y.shape[1], -1, 2, y.shape[3]).mean((2, 3, 4))), True),
    "attention within windows of 2 rows": (lambda m, y: _window_attention(y), False),
}
"""An image cut into windows of rows (every tile's rows a multiple of 2): the windows
counted in the points' dim, each window whole on one rank."""


def _split_back(table, case, sizes, dim):
    head, pooled = {"split back": SPLIT_BACK, "windows": WINDOWS}[table][case]
    shape = (2, 2, sum(sizes), 5) if dim == -2 else (2, 2, 5, sum(sizes))
    return check(lambda: Reduced(head), shape, (dim,), (sizes,), steps=2, replicated=pooled)


@pytest.mark.parametrize("case", sorted(SPLIT_BACK))
@pytest.mark.parametrize("dim", [-2, -1])
def test_tokens_split_back_into_rows_and_columns_equal_dense(case, dim):
    assert max(run_distributed(_split_back, 2, "split back", case, [5, 7], dim, timeout=T)) < 1e-10
    assert max(run_distributed(_split_back, 3, "split back", case, [4, 0, 8], dim,
                               timeout=T)) < 1e-10


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_windows_of_rows_equal_dense(case):
    assert max(run_distributed(_split_back, 2, "windows", case, [4, 8], -2, timeout=T)) < 1e-10
    assert max(run_distributed(_split_back, 2, "windows", case, [6, 6], -2, timeout=T)) < 1e-10
    assert max(run_distributed(_split_back, 3, "windows", case, [2, 0, 10], -2,
                               timeout=T)) < 1e-10


SPLIT_BACK_REFUSED: dict[str, Head] = {
    "channels last, softmax along the split dim": lambda m, y: _channels_last(y).softmax(
        1 if m.split_dim == -2 else 2),
    "channels last, a cumsum along the split dim": lambda m, y: _channels_last(y).cumsum(
        1 if m.split_dim == -2 else 2),
}


def _split_back_refused(case, sizes, dim):
    from tensorpar.nn import parallelize_domain
    dense = Reduced(SPLIT_BACK_REFUSED[case]).double()
    dense.split_dim = dim
    model = parallelize_domain(dense, dims=dim)
    n = sizes[torch.distributed.get_rank()]
    x = torch.randn(2, 2, *((n, 5) if dim == -2 else (5, n)), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"points"):
        model(x)
    return True


@pytest.mark.parametrize("case", sorted(SPLIT_BACK_REFUSED))
@pytest.mark.parametrize("dim", [-2, -1])
def test_tokens_split_back_then_reduced_along_the_split_dim_are_refused(case, dim):
    assert all(run_distributed(_split_back_refused, 2, case, [5, 7], dim, timeout=T))
    assert all(run_distributed(_split_back_refused, 3, case, [4, 0, 8], dim, timeout=T))


def _one_window(sizes, refused):
    if not refused:
        return _split_back("windows", "windows of 2 rows, mean over every window", sizes, -2)
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Reduced(WINDOWS["windows of 2 rows, softmax within each"][0])
                               .double(), dims=-2)
    x = torch.randn(2, 2, sizes[torch.distributed.get_rank()], 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="points"):
        model(x)
    return 0.0


def test_one_window_per_tile_is_read_both_ways():
    """With one window per tile, the dim counting the windows (size 1) and the one holding
    its rows read alike on every rank: both hold the points. A reduction over both is the
    domain's; one along the rows of a window alone raises (it cannot tell)."""
    for sizes in ([2, 2], [2, 2, 2], [2, 0, 2]):
        assert max(run_distributed(_one_window, len(sizes), sizes, False, timeout=T)) < 1e-10
    assert max(run_distributed(_one_window, 2, [2, 2], True, timeout=T)) == 0.0
    # a tile of more windows decides for the others: the window's rows run as they are
    assert max(run_distributed(_split_back, 3, "windows", "windows of 2 rows, softmax within "
                               "each", [2, 0, 4], -2, timeout=T)) < 1e-10


def _not_followed(case):
    from torch.distributed.device_mesh import init_device_mesh

    from tensorpar.nn import parallelize_domain
    heads = {"one-column tiles, channels last, a mean over the rows":
             (lambda m, y: m.fc(_channels_last(y).mean(1).mean(1)), (-1,), (2, 2, 5, 1), None),
             "a mesh's tokens as channels last, a softmax along the rows":
             (lambda m, y: _channels_last(y).softmax(1), (-2, -1), (1, 2, 3, 2), (2, 2)),
             "a mesh's tokens as channels last, a roll along the rows":
             (lambda m, y: _channels_last(y).roll(1, 1), (-2, -1), (1, 2, 3, 2), (2, 2))}
    head, dims, shape, mesh = heads[case]
    group = None if mesh is None else init_device_mesh("cpu", mesh)
    model = parallelize_domain(Reduced(head).double(), dims=dims, group=group)
    with pytest.raises(ValueError, match="not followed" if mesh is None else "dim"):
        model(torch.randn(*shape, dtype=torch.float64))
    return True


@pytest.mark.parametrize("case", ["one-column tiles, channels last, a mean over the rows",
                                  "a mesh's tokens as channels last, a softmax along the rows",
                                  "a mesh's tokens as channels last, a roll along the rows"])
def test_what_a_reshape_not_followed_gives_refuses_what_needs_its_points(case):
    """Where the ranks cannot read a reshape (every tile one column wide), its result is not
    taken for an image: a reduction of it raises on every rank. A mesh's tokens split back
    into rows and columns are followed: a softmax or a roll along the rows raises as on any
    tile whose dim holds the points."""
    world = 2 if case.startswith("one-column") else 4
    assert all(run_distributed(_not_followed, world, case, timeout=T))


class _Halves(nn.Module):
    """Each tile cut in two halves and joined back (in order, or swapped round), then
    normalised and a softmax over the channels."""

    def __init__(self, swapped: bool) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.swapped = swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        halves = y.reshape(b, c, 2, -1) * 2
        if self.swapped:
            halves = halves.transpose(2, 3)
        return self.norm(halves.reshape(b, c, h, w)).softmax(1)


def _halves(case, swapped):
    mesh = case == "mesh"
    shape, dims, splits = ((1, 2, 6, 6), (-2, -1), ([3, 3], [2, 4])) if mesh else \
        ((1, 2, 2, 6), (-2,), ([1, 1],))
    if not swapped:
        return check(lambda: _Halves(False), shape, dims, splits,
                     mesh_shape=(2, 2) if mesh else None)
    from torch.distributed.device_mesh import init_device_mesh

    from tensorpar.nn import parallelize_domain
    from tests._domain_check import _coords, tile_of
    model = _Halves(True).double()
    group = init_device_mesh("cpu", (2, 2)) if mesh else None
    model = parallelize_domain(model, dims=dims, group=group)
    x = tile_of(torch.randn(*shape, dtype=torch.float64), dims, splits,
                _coords((2, 2) if mesh else None))
    with pytest.raises(ValueError, match="not known: not converted"):  # (the norm)
        model(x)
    return 0.0


@pytest.mark.parametrize("case", ["one-row tiles", "mesh"])
def test_a_reshape_not_followed_and_back_in_order_is_the_image_again(case):
    """A tile cut into halves the ranks cannot read (one-row tiles, a mesh) and reshaped
    back in the same order is the image again: a softmax over its channels equals dense.
    Swapped round on the way, it is not: the norm after it raises on every rank."""
    world = 4 if case == "mesh" else 2
    assert max(run_distributed(_halves, world, case, False, timeout=T)) < 1e-10
    assert max(run_distributed(_halves, world, case, True, timeout=T)) == 0.0


class _TokenNorm(nn.Module):
    """Tokens of the tile, a LayerNorm over their channels, back to the image."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4) if norm == "layer" else nn.GroupNorm(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        t = y.flatten(2).transpose(1, 2)  # (B, h * w, C)
        if isinstance(self.norm, nn.LayerNorm):
            return self.norm(t).transpose(1, 2).reshape(y.shape)
        return self.norm(t.transpose(1, 2)).reshape(y.shape)  # (B, C, h * w): over tokens


def _token_norm(norm, sizes, dim):
    if norm == "layer":
        shape = (2, 2, 3, sum(sizes)) if dim == -1 else (2, 2, sum(sizes), 3)
        return check(lambda: _TokenNorm("layer"), shape, (dim,), (sizes,), steps=2)
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(_TokenNorm("group").double(), dims=dim)
    x = torch.randn(2, 2, sizes[torch.distributed.get_rank()], 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="reshaped tile"):
        model(x)
    return 0.0


def test_norm_layers_on_tokens():
    """A LayerNorm over the channels of tokens is the dense one, split along H or W (along
    W, with tiles as wide as the channels are many, it was taken for a LayerNorm over the
    split dim); a GroupNorm over tokens, whose statistics would take in their points,
    raises on every rank."""
    for sizes, dim in (([4, 4], -1), ([5, 7], -1), ([4, 0, 8], -2)):
        assert max(run_distributed(_token_norm, len(sizes), "layer", sizes, dim,
                                   timeout=T)) < 1e-10
    assert max(run_distributed(_token_norm, 2, "group", [5, 7], -2, timeout=T)) == 0.0
