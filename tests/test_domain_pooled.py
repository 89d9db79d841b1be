"""After a global pooling the model continues replicated; pooled features fed back into
the tiles (squeeze-and-excitation, DeepLab's image-pooling branch) and a tile that meets
a converted layer after the pooling are refused at the call, on every rank, rather than
run without their halos. A head on the pooled features still equals dense."""

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
    """The pooled summary computed before the tiles' own convolution, no mixing."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.conv = nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summary = self.pool(x).flatten(1)
        return self.conv(x), summary


class GateCopied(SqueezeExcite):
    """The gate written into a fresh buffer first (an in-place write carries the mark)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        gate = torch.sigmoid(self.fc(self.pool(y)))
        buffer = torch.empty(gate.shape, dtype=gate.dtype)
        buffer[:] = gate
        return y * buffer  # (no converted layer after it to catch the tile)


MODELS = {"squeeze_excite": SqueezeExcite, "image_pooling": ImagePooling,
          "pool_first": PoolFirst, "gate_copied": GateCopied}


def _refused(name):
    from tensorpar.nn import parallelize_domain
    torch.manual_seed(0)
    model = parallelize_domain(MODELS[name](), dims=-2)
    with pytest.raises(RuntimeError, match="global pooling") as err:
        model(torch.randn(1, 2, 4 + torch.distributed.get_rank(), 6))
    return str(err.value)


@pytest.mark.parametrize("name", list(MODELS))
def test_tiles_after_a_global_pooling_are_refused(name):
    messages = run_distributed(_refused, 2, name, timeout=T)
    assert len(messages) == 2


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
