"""After a global pooling the model may go on with the pooled (replicated) features and
the tiles side by side, and bring the pooled features back into the tiles
(squeeze-and-excitation, DeepLab's image-pooling branch): every such model equals dense.
A head on the pooled features equals dense; pooled features spread over the tile's points
by a call that is not followed are refused at the call."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.out(y * torch.sigmoid(self.fc(self.pool(y))))


class ImagePooling(nn.Module):
    """DeepLab's ASPP, reduced to a 3x3 branch and the image-pooling branch."""

    def __init__(self) -> None:
        super().__init__()
        self.branch, self.proj = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(2, 4, 1)
        self.pool, self.out = nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.proj(self.pool(x)), size=x.shape[-2:], mode="bilinear")
        return self.out(torch.cat([self.branch(x), pooled], 1))


class PoolFirst(nn.Module):
    """The pooled summary computed before the tile's own convolution, then its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.conv = nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summary = self.fc(self.pool(x).flatten(1))
        return self.conv(x) * torch.sigmoid(summary)[:, :, None, None]


class GateCopied(SqueezeExcite):
    """The gate written into a fresh buffer first (an in-place write carries the mark)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gate = torch.sigmoid(self.fc(self.pool(y)))
        buffer = torch.empty(gate.shape, dtype=gate.dtype)
        buffer[:] = gate
        return self.out(y * buffer)


class Expanded(SqueezeExcite):
    """The gate expanded to the tile's size, then added: a spread the conversion follows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gate = torch.tanh(self.fc(self.pool(y))).expand(-1, -1, *y.shape[2:])
        return self.out(torch.cat([y, gate], 1)[:, :4] + gate)


class TwoBlocksAndHead(nn.Module):
    """Two squeeze-and-excitation blocks, a strided convolution and BatchNorm between them,
    and a classifier head on a last global pooling: the output is replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = SqueezeExcite(), SqueezeExcite()
        self.down, self.norm = nn.Conv2d(2, 2, 3, stride=2, padding=1), nn.BatchNorm2d(2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.norm(self.down(self.a(x)))))


class UpsampledHead(nn.Module):
    """Pooled features up-sampled to a fixed 3 x 3 grid and convolved as dense: they stay
    pooled (3 rows are one rank's tile here but not the other's), the output replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.head_conv, self.fc = nn.Conv2d(4, 2, 3, padding=1), nn.Linear(18, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = F.interpolate(self.pool(self.conv(x)), size=(3, 3), mode="nearest")
        return self.fc(self.head_conv(grid).flatten(1))


def _exact(name, sizes):
    return check(MODELS[name], (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2,
                 replicated=name in REPLICATED)


MODELS = {"squeeze_excite": SqueezeExcite, "image_pooling": ImagePooling,
          "pool_first": PoolFirst, "gate_copied": GateCopied, "expanded": Expanded,
          "two_blocks_and_head": TwoBlocksAndHead, "upsampled_head": UpsampledHead}
REPLICATED = {"two_blocks_and_head", "upsampled_head"}


@pytest.mark.parametrize("name", list(MODELS))
def test_pooled_features_back_in_the_tiles_equal_dense(name):
    assert max(run_distributed(_exact, 2, name, [4, 3], timeout=T)) < 1e-10


@pytest.mark.parametrize("name", ["squeeze_excite", "image_pooling", "two_blocks_and_head",
                                  "upsampled_head"])
def test_pooled_features_back_in_the_tiles_equal_dense_at_three_ranks(name):
    # [3, 0, 4]: an empty tile; 3 rows is the up-sampled head's grid on one rank only
    assert max(run_distributed(_exact, 3, name, [3, 0, 4], timeout=T)) < 1e-10


def _on_a_grid(name):
    return check(MODELS[name], (2, 2, 7, 9), (-2, -1), ([4, 3], [5, 4]), mesh_shape=(2, 2),
                 steps=2, replicated=name in REPLICATED)


@pytest.mark.parametrize("name", ["image_pooling", "expanded", "two_blocks_and_head"])
def test_pooled_features_back_in_a_grid_of_tiles_equal_dense(name):
    assert max(run_distributed(_on_a_grid, 4, name, timeout=T)) < 1e-10


class Unfollowed(nn.Module):
    """Pooled features spread to the tile's shape by a fresh constant: not followed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        spread = self.pool(y) * torch.ones(y.shape[-2:])
        return self.conv(torch.cat([y, spread], 1)[:, :2])


def _unfollowed():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Unfollowed(), dims=-2)
    with pytest.raises(RuntimeError, match="not followed") as err:
        model(torch.randn(1, 2, 4 + torch.distributed.get_rank(), 6))
    return "cat" in str(err.value)


def test_pooled_features_spread_in_a_way_not_followed_are_refused():
    assert all(run_distributed(_unfollowed, 2, timeout=T))


def head():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _head(sizes):
    return check(head, (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2, replicated=True)


def test_a_head_on_the_pooled_features_still_equals_dense():
    assert max(run_distributed(_head, 2, [4, 3], timeout=T)) < 1e-10


class GateAsNumber(SqueezeExcite):
    """The gate taken out as a Python number: no gradient reaches the gate's layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.out(y) * torch.sigmoid(self.fc(self.pool(y))).mean().item()


def _no_gradient():
    from tensorpar.nn import parallelize_domain
    torch.manual_seed(0)
    model = parallelize_domain(GateAsNumber(), dims=-2)
    model(torch.randn(1, 2, 4 + torch.distributed.get_rank(), 6)).sum().backward()
    # as dense: no gradient reached fc, so it has none (zeros would move AdamW's decay)
    return model.fc.weight.grad is None and model.conv.weight.grad is not None


def test_a_layer_no_gradient_reaches_keeps_none():
    assert all(run_distributed(_no_gradient, 2, timeout=T))


class SegmentAndClassify(nn.Module):
    """A loss made on each rank: the tile's segmentation part plus the pooled class part,
    with tensors that take a tile only for its dtype or shape (``type_as``, ``new_zeros``,
    ``zeros_like``) and a layer whose weight is only looked at (no gradient, as dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.seg = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.pool, self.cls, self.spare = nn.AdaptiveAvgPool2d(1), nn.Linear(5, 3), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.enc(x))
        seg_loss = self.seg(f).pow(2).sum() + torch.zeros_like(x).sum()
        pooled = self.pool(f).flatten(1).type_as(x).to(x)
        features = torch.cat([pooled, x.new_zeros(x.shape[0], 1)], 1)
        assert self.spare.weight.dtype == x.dtype
        return seg_loss + self.cls(features).pow(2).sum()


def _loss_on_each_rank():
    import copy
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    dense = SegmentAndClassify().double()
    x = torch.randn(2, 2, 9, 6, dtype=torch.float64)
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(copy.deepcopy(dense), dims=-2)
    dense(x).backward()
    model(x.narrow(2, [0, 5][rank], [5, 4][rank])).backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), dense.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            worst = max(worst, float((p.grad - q.grad).abs().max()))
    return worst


def test_a_loss_of_tile_and_pooled_parts_on_each_rank_equals_dense():
    assert max(run_distributed(_loss_on_each_rank, 2, timeout=T)) < 1e-10


class FunctionalPooling(nn.Module):
    def __init__(self, size: int = 1) -> None:
        super().__init__()
        self.size = size
        self.conv, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(self.conv(x), self.size)
        return self.head(pooled.flatten(1))


def _functional_pooling(sizes):
    return check(FunctionalPooling, (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2,
                 replicated=True)


def test_a_global_pooling_written_as_a_call_equals_dense():
    assert max(run_distributed(_functional_pooling, 3, [4, 0, 3], timeout=T)) < 1e-10


def _pooling_to_two():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(FunctionalPooling(2), dims=-2)
    with pytest.raises(ValueError, match="only output size 1"):
        model(torch.randn(1, 2, 4, 5))
    return True


def test_a_functional_pooling_to_other_sizes_is_refused():
    assert all(run_distributed(_pooling_to_two, 2, timeout=T))


class MeanExcite(SqueezeExcite):
    """Squeeze-and-excitation with the pooling written as a mean (timm's ``SqueezeExcite``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.out(y * torch.sigmoid(self.fc(y.mean((2, 3), keepdim=True))))


class MeanHead(nn.Module):
    """A head on ``torch.mean(x, dim=[-2, -1])``, with a channel softmax on the tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.softmax(self.conv(x), dim=1)
        return self.fc(torch.mean(y, dim=[-2, -1]))


def _mean(name, sizes, mesh):
    build = {"excite": MeanExcite, "head": MeanHead}[name]
    if mesh:
        return check(build, (2, 2, 7, 9), (-2, -1), ([4, 3], [5, 4]), mesh_shape=(2, 2),
                     steps=2, replicated=name == "head")
    return check(build, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2,
                 replicated=name == "head")


@pytest.mark.parametrize("name", ["excite", "head"])
def test_a_global_pooling_written_as_a_mean_equals_dense(name):
    assert max(run_distributed(_mean, 3, name, [3, 0, 4], False, timeout=T)) < 1e-10
    assert max(run_distributed(_mean, 4, name, None, True, timeout=T)) < 1e-10


class AlongSplit(nn.Module):
    def __init__(self, call) -> None:
        super().__init__()
        self.conv, self.call = nn.Conv2d(2, 2, 3, padding=1), call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.conv(x))


ALONG = {"softmax": lambda y: F.softmax(y, dim=-2), "max_with_indices": lambda y: y.max(2)[0],
         "var": lambda y: y.var((2, 3)), "cumsum": lambda y: y.cumsum(2),
         "mean_of_h_only": lambda y: y.mean(2)}


def _along(name):
    from tensorpar.nn import parallelize_domain
    group = None
    if name == "mean_of_h_only":  # 2 x 2 tiles: a mean over H leaves W split
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", (2, 2))
    model = parallelize_domain(AlongSplit(ALONG[name]), dims=(-2, -1) if group else -2,
                               group=group)
    with pytest.raises(ValueError, match="tile's points alone"):
        model(torch.randn(1, 2, 4, 5))
    return True


@pytest.mark.parametrize("name", list(ALONG))
def test_calls_along_a_split_dim_are_refused(name):
    assert all(run_distributed(_along, 4 if name == "mean_of_h_only" else 2, name, timeout=T))


class ConstantTileAfterPooling(SqueezeExcite):
    """After a global pooling, a converted layer on ``torch.ones_like(tile)``: a tile still
    (run as dense, the cut rows would see zero padding instead of the neighbour's ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.side(torch.ones_like(self.conv(x)))


def _constant_tile(sizes):
    return check(ConstantTileAfterPooling, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


def test_a_constant_tile_made_after_a_pooling_is_a_tile():
    assert max(run_distributed(_constant_tile, 3, [3, 0, 4], timeout=T)) < 1e-10


class ScaleComputedFirst(nn.Module):
    """A parameter's function computed before the pooling (a logit scale), used on the head's
    output after it: the gradient that reaches the parameter there is whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.scale, self.head = nn.Parameter(torch.tensor(0.3)), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.exp()
        return self.head(self.pool(self.conv(x)).flatten(1)) * scale


class TimestepOnBothSides(nn.Module):
    """A timestep embedding computed once at the top (as diffusion U-Nets do), added in a
    block before a squeeze-and-excitation pooling and in one after it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.before, self.after = nn.Linear(1, 4), nn.Linear(4, 2), nn.Linear(4, 2)
        self.c1, self.c2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = torch.tanh(self.embed(t))
        y = self.c1(x) + self.before(emb)[:, :, None, None]
        y = y * torch.sigmoid(self.fc(self.pool(y)))
        return self.c2(y) + self.after(emb)[:, :, None, None]


class MaskOnBothSides(nn.Module):
    """A constant mask of the tile's size made before the pooling, convolved before and after
    it: a tile both times (the same tensor takes the same road)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.mask = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(1, 2, 3, padding=1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(x.shape[0], 1, *x.shape[2:], dtype=x.dtype)
        y = self.conv(x) + self.mask(ones)
        y = y * torch.sigmoid(self.fc(self.pool(y)))
        return y + self.mask(ones)


def _used_on_both_sides(name, sizes):
    extra = (lambda: (torch.randn(2, 1, dtype=torch.float64),)) if name == "timestep" else None
    return check(BOTH_SIDES[name], (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2,
                 extra=extra, replicated=name == "scale")


BOTH_SIDES = {"scale": ScaleComputedFirst, "timestep": TimestepOnBothSides,
              "mask": MaskOnBothSides}


@pytest.mark.parametrize("name", list(BOTH_SIDES))
def test_a_tensor_made_before_the_pooling_and_used_after_it_equals_dense(name):
    assert max(run_distributed(_used_on_both_sides, 2, name, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_used_on_both_sides, 3, name, [3, 0, 4], timeout=T)) < 1e-10


class GateOnTokens(nn.Module):
    """A gate multiplied into the tile's flattened tokens: refused (the tile's dims are gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.out = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        tokens = y.flatten(2).transpose(1, 2)
        gated = tokens * torch.sigmoid(self.pool(y).flatten(2).transpose(1, 2))
        return self.out(y + gated.transpose(1, 2).reshape(b, c, h, w))


def _gate_on_tokens(sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(GateOnTokens(), dims=-2)
    rank = torch.distributed.get_rank()
    with pytest.raises(RuntimeError, match="not followed"):
        model(torch.randn(1, 2, sizes[rank], 6))
    return True


def test_a_refused_mix_raises_on_every_rank_also_with_an_empty_tile():
    # the empty tile's rank sees no element spread, and must raise with the others
    assert all(run_distributed(_gate_on_tokens, 3, [3, 0, 4], timeout=120))


class GridAfterStride(nn.Module):
    """Pooled features up-sampled to a fixed 2 x 2 grid for a dense head, after a strided
    convolution: 2 rows is every rank's tile of the strided output (split [2, 2]), yet the
    grid is pooled features, as in the dense model."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.pool = nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(1)
        self.head_conv, self.fc = nn.Conv2d(4, 2, 3, padding=1), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = F.interpolate(self.pool(self.down(x)), size=(2, 2), mode="nearest")
        return self.fc(self.head_conv(grid).flatten(1))


def _grid_after_stride():
    return check(GridAfterStride, (2, 2, 7, 6), (-2,), ([4, 3],), steps=2, replicated=True)


def test_a_fixed_grid_the_size_of_every_tile_stays_pooled():
    assert max(run_distributed(_grid_after_stride, 2, timeout=T)) < 1e-10


@pytest.mark.parametrize("name", ["image_pooling", "expanded", "gate_copied"])
def test_pooled_features_spread_to_an_even_split_meet_the_tiles(name):
    # every tile 4 rows: the spread's size alone does not tell a tile from a fixed grid
    assert max(run_distributed(_exact, 2, name, [4, 4], timeout=T)) < 1e-10


class ConvolvedSpread(ImagePooling):
    """The image-pooling branch convolved after its spread, before it meets the tile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.proj(self.pool(x)), size=x.shape[-2:], mode="bilinear")
        return self.out(torch.cat([self.branch(x), self.branch(pooled[:, :2])], 1))


def _convolved_spread(sizes):
    return check(ConvolvedSpread, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=1)


@pytest.mark.parametrize("sizes", [[4, 3], [4, 4]])
def test_a_spread_convolved_before_it_meets_the_tile(sizes):
    # [4, 4]: the tiles' size does not tell a tile from a fixed grid; the meeting does
    assert max(run_distributed(_convolved_spread, 2, sizes, timeout=T)) < 1e-10


class AddedInPlace(TimestepOnBothSides):
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.before(torch.tanh(self.embed(t)))
        emb.add_(self.pool(self.c1(x)).flatten(1))  # its gradient would be whole on every rank
        return emb


def _added_in_place():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(AddedInPlace(), dims=-2)
    with pytest.raises(ValueError, match="Write out of place"):
        model(torch.randn(1, 2, 4, 6), torch.randn(1, 1))
    return True


def test_pooled_features_added_in_place_into_a_parameters_function_are_refused():
    assert all(run_distributed(_added_in_place, 2, timeout=T))


class ParameterSpreadAfterPooling(SqueezeExcite):
    """After the pooling, a parameter expanded to the tile's size and added to it: a
    replicated tensor on the tile's points, its gradient partial (as before a pooling)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 4, 1, 1))
        self.mix = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gated = y * torch.sigmoid(self.fc(self.pool(y)))
        return self.out(gated + self.mix(self.bias).expand(-1, -1, *y.shape[2:]))


class EinsumGate(SqueezeExcite):
    """The gate multiplied in with ``einsum`` (batch and channel subscripts only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gate = torch.sigmoid(self.fc(self.pool(y))).flatten(1)
        return self.out(torch.einsum("bchw,bc->bchw", y, gate))


class InterpolateByKeyword(ImagePooling):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(input=self.proj(self.pool(x)), size=x.shape[-2:], mode="bilinear")
        return self.out(torch.cat([self.branch(x), pooled], 1))


MORE = {"parameter_spread": ParameterSpreadAfterPooling, "einsum": EinsumGate,
        "keyword": InterpolateByKeyword}


def _more(name, sizes):
    return check(MORE[name], (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("name", list(MORE))
def test_more_ways_pooled_features_and_parameters_meet_the_tiles(name):
    assert max(run_distributed(_more, 2, name, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_more, 3, name, [3, 0, 4], timeout=T)) < 1e-10


class SpreadConvolved(nn.Module):
    """The image-pooling branch spread to the tile's size and convolved: returned as the
    output, or added to the tile after the convolution."""

    def __init__(self, added: bool) -> None:
        super().__init__()
        self.added = added
        self.conv, self.pool = nn.Conv2d(2, 2, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.proj, self.out = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        spread = F.interpolate(self.proj(self.pool(y)), size=y.shape[-2:], mode="nearest")
        if self.added:
            return y + self.out(torch.relu(spread))
        return self.out(spread) + 0 * y.mean()


class SpreadPooledAgain(SpreadConvolved):
    """The convolved spread pooled again for a gate: at an even split, refused."""

    def __init__(self) -> None:
        super().__init__(added=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        spread = F.interpolate(self.proj(self.pool(y)), size=y.shape[-2:], mode="nearest")
        return y * torch.sigmoid(self.pool(self.out(spread)))


def _spread_convolved(how, sizes):
    build = {"returned": lambda: SpreadConvolved(False), "added": lambda: SpreadConvolved(True),
             "pooled_again": SpreadPooledAgain}[how]
    if how != "added" and len(set(sizes)) == 1:
        # an even split: a tile or a fixed grid of that size? Nothing tells; refused
        from tensorpar.nn import parallelize_domain
        model = parallelize_domain(build(), dims=-2)
        with pytest.raises(ValueError, match="cannot be told"):
            model(torch.randn(1, 2, sizes[torch.distributed.get_rank()], 6))
        return 0.0
    return check(build, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("how", ["returned", "added", "pooled_again"])
@pytest.mark.parametrize("sizes", [[4, 3], [4, 4]])
def test_a_spread_convolved_after_it(how, sizes):
    # uneven: a tile at once; even: told where it meets a tile, else refused
    assert max(run_distributed(_spread_convolved, 2, how, sizes, timeout=T)) < 1e-10


class EmbeddingThroughLayers(nn.Module):
    """A timestep embedding made at the top, of shape (B, C, 1, 1), through a converted
    1x1 convolution (before or after the pooling) and a BatchNorm1d, into the gate and the
    head: replicated data, run as the dense layers."""

    def __init__(self, project_first: bool) -> None:
        super().__init__()
        self.project_first = project_first
        self.embed = nn.Linear(1, 4)
        self.conv, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.proj, self.out = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 2, 3, padding=1)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = F.silu(self.embed(t))
        projected = self.proj(emb[:, :, None, None]) if self.project_first else None
        y = self.conv(x)
        pooled = self.pool(y)
        if projected is None:
            projected = self.proj(emb[:, :, None, None])
        gate = torch.sigmoid(pooled + projected + self.norm(emb)[:, :, None, None])
        return self.out(y * gate)


class WeightNormGate(SqueezeExcite):
    """The gate's linear layer weight-normalised (a parametrization: never sees the image)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gate = torch.sigmoid(self.lin(self.pool(y).flatten(1)))
        return self.out(y * gate[:, :, None, None])


def _replicated_inputs(name, sizes):
    build = {"embedding_first": lambda: EmbeddingThroughLayers(True),
             "embedding_after": lambda: EmbeddingThroughLayers(False),
             "weight_norm": WeightNormGate}[name]
    extra = (lambda: (torch.randn(2, 1, dtype=torch.float64),)) if "embedding" in name \
        else None
    return check(build, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2, extra=extra)


@pytest.mark.parametrize("name", ["embedding_first", "embedding_after", "weight_norm"])
def test_replicated_data_through_converted_layers_equals_dense(name):
    assert max(run_distributed(_replicated_inputs, 2, name, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_replicated_inputs, 3, name, [3, 0, 4], timeout=T)) < 1e-10


def _unfollowed_one_row(sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(Unfollowed(), dims=-2)
    with pytest.raises(RuntimeError, match="not followed"):
        model(torch.randn(1, 2, sizes[torch.distributed.get_rank()], 6))
    return True


def test_a_refused_spread_raises_on_every_rank_with_a_one_row_tile():
    # the 1-row tile's rank sees a pooled operand of size 1 there, a gate's shape
    assert all(run_distributed(_unfollowed_one_row, 2, [1, 3], timeout=120))


class SpreadNormalised(ImagePooling):
    """The image-pooling branch spread, then a BatchNorm, then joined to the tile."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spread = F.interpolate(self.proj(self.pool(x)), size=x.shape[-2:], mode="nearest")
        return self.out(torch.cat([self.branch(x), self.norm(spread)], 1))


def _spread_normalised(sizes):
    # check() compares the running statistics with dense's too
    return check(SpreadNormalised, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


@pytest.mark.parametrize("sizes", [[4, 3], [4, 4]])
def test_a_norm_on_a_spread_updates_its_statistics_once(sizes):
    assert max(run_distributed(_spread_normalised, 2, sizes, timeout=T)) < 1e-10


class LossTerms(nn.Module):
    """A loss made in the forward of a tile's part and pooled parts, summed in any order,
    with a term of parameters alone (a weight penalty)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.enc, self.seg = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.pool, self.cls, self.aux = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3), nn.Linear(4, 2)
        self.logvar = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.enc(x))
        p = self.pool(f).flatten(1)
        seg, cls, aux = self.seg(f).pow(2).sum(), self.cls(p).pow(2).sum(), self.aux(p).pow(2).sum()
        if self.how == "weighted":  # the mixed loss times a learned weight: refused
            return (seg + cls) * torch.exp(-self.logvar) + self.logvar
        if self.how == "sqrt":  # an L2 norm of the tile's part alone: refused
            return torch.sqrt(seg)
        if self.how == "squared":
            return (seg + cls) ** 2
        if self.how == "product":  # of two tile parts
            return seg * f.sum()
        if self.how == "scaled":  # linear: kept (``.to(f)`` reads f's dtype alone)
            return (0.5 * (seg / 7 - f.abs().sum()) + aux).to(f)
        return (seg + cls) + aux + self.aux.weight.pow(2).sum() + self.logvar


def _loss_terms(how, sizes):
    import copy
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    dense = LossTerms(how).double()
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(copy.deepcopy(dense), dims=-2)
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank])
    if how in REFUSED_LOSSES:
        with pytest.raises(ValueError, match=REFUSED_LOSSES[how]):
            model(tile)
        return 0.0
    dense(x).backward()
    model(tile).backward()
    return max(float((p.grad - q.grad).abs().max()) if q.grad is not None
               else float(p.grad is not None)  # (unused in dense: unused here too)
               for p, q in zip(model.parameters(), dense.parameters(), strict=True))


REFUSED_LOSSES = {"weighted": "only sums", "sqrt": "summed over the ranks",
                  "squared": "summed over the ranks", "product": "summed over the ranks"}
"""Each rank's loss is its part, summed over the ranks by backward: a function of it that is
not linear (or a product of two parts) would differ from dense, silently."""


@pytest.mark.parametrize("how", ["summed", "scaled", *REFUSED_LOSSES])
def test_a_loss_of_several_tile_and_pooled_terms(how):
    assert max(run_distributed(_loss_terms, 2, how, [5, 4], timeout=T)) < 1e-10
    assert max(run_distributed(_loss_terms, 3, how, [3, 0, 4], timeout=T)) < 1e-10


class LearnedGridHead(nn.Module):
    """A learned 4 x 4 grid (a parameter) activated at the top, convolved after the pooling:
    replicated data, the dense layer (its 4 rows are no tile's, or every tile's)."""

    def __init__(self) -> None:
        super().__init__()
        self.grid = nn.Parameter(torch.randn(1, 4, 4, 4))
        self.conv, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.head, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.tanh(self.grid)
        pooled = self.pool(self.conv(x))
        return self.fc((self.head(grid) * pooled).flatten(1))


def _learned_grid(sizes):
    return check(LearnedGridHead, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2,
                 replicated=True)


@pytest.mark.parametrize("sizes", [[4, 3], [4, 4], [3, 0, 4]])
def test_a_learned_grid_convolved_after_the_pooling_equals_dense(sizes):
    # [4, 3]: one rank's tile is 4 rows, the other's not (a rank-by-rank reading hung)
    assert max(run_distributed(_learned_grid, len(sizes), sizes, timeout=T)) < 1e-10


def test_a_mask_at_one_row_tiles_is_a_tile():
    assert max(run_distributed(_used_on_both_sides, 2, "mask", [1, 1], timeout=T)) < 1e-10


class FastWeights(nn.Module):
    """`SqueezeExcite` run by ``torch.func.functional_call`` with weights computed from
    parameters (a scaled copy): its head, a converted 1x1 convolution on pooled features,
    gets plain tensors where its parameters were."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.scale = SqueezeExcite(), nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = {k: v * self.scale for k, v in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, weights, (x,))


def _fast_weights(sizes):
    return check(FastWeights, (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2)


def test_weights_given_by_functional_call_on_pooled_features_give_shares():
    # (the head's gradient was counted once per tile: 2x dense at 2 ranks)
    assert max(run_distributed(_fast_weights, 2, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_fast_weights, 3, [4, 0, 8], timeout=T)) < 1e-10


class PooledHyperWeights(nn.Module):
    """A 1x1 convolution on pooled features run with weights computed from them (a
    hypernetwork): the weights' gradient is whole on every rank, no share."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.hyper, self.out = nn.Linear(4, 16), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = y.mean((2, 3), keepdim=True)
        w = self.hyper(z.mean(0).flatten()).view(4, 4, 1, 1)
        g = torch.func.functional_call(self.fc, {"weight": w, "bias": self.fc.bias}, (z,))
        return self.out(y * torch.sigmoid(g))


def _hyper(sizes):
    return check(PooledHyperWeights, (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2)


def test_weights_computed_from_pooled_features_give_no_share():
    # (their gradient was divided by the number of tiles: 0.5x dense at 2 ranks)
    assert max(run_distributed(_hyper, 2, [5, 7], timeout=T)) < 1e-10
