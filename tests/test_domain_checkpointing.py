"""Activation checkpointing inside a domain-parallel model: its recomputation runs outside the
model's forward, where the tiles' exchanges and reductions are not converted. A reentrant
checkpoint gave wrong gradients silently (off by 1.5 around two convolutions, by 2.0 around
a mean over the points) and hung with an empty tile; it is refused in the forward, on every
rank."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensorpar.testing import run_distributed
from tests._domain_check import check_or_error

pytestmark = pytest.mark.timeout(300)
T = 200


class Checkpointed(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        if self.how == "convolutions":
            y = checkpoint(lambda t: self.c2(t).relu(), y, use_reentrant=True)
        elif self.how == "a mean over the points":
            y = checkpoint(lambda t: t * t.mean((2, 3), keepdim=True), y, use_reentrant=True)
        else:  # the model's output itself
            return checkpoint(lambda t: self.c3(t) * 2, y, use_reentrant=True)
        return self.c3(y)


def _refused(how, hs):
    out = check_or_error(lambda: Checkpointed(how), hs, [5], None)
    assert isinstance(out, str) and "checkpoint" in out, out
    return True


@pytest.mark.parametrize("how", ["convolutions", "a mean over the points", "the output"])
def test_a_reentrant_checkpoint_inside_is_refused_on_every_rank(how):
    assert all(run_distributed(_refused, 2, how, [5, 7], timeout=T))
    assert all(run_distributed(_refused, 3, how, [4, 0, 8], timeout=T))


class _NormBlock(nn.Module):
    """A norm, an activation and a convolution: its halo rows go ahead from a step on."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.bn(self.c1(x))))


def _whole_model_checkpointed(reentrant, calls=1):
    import copy

    import torch.distributed as dist

    from tensorpar.nn import parallelize_domain

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = _NormBlock().double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    worst = 0.0
    for step in range(3):  # the recomputation repeats the forward it follows, every step
        x = torch.randn(2, 1, 10, 5, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        tile = x.tensor_split(world, -2)[rank].clone().requires_grad_()
        whole = x.clone().requires_grad_()
        dense.zero_grad()
        par.zero_grad()
        sum(dense(whole * (c + 1)).square().sum() for c in range(calls)).backward()
        sum(checkpoint(par, tile * (c + 1), use_reentrant=reentrant).square().sum()
            for c in range(calls)).backward()
        worst = max(worst, float((tile.grad - whole.grad.tensor_split(world, -2)[rank])
                                 .abs().max()))
        for p, q in zip(par.parameters(), dense.parameters(), strict=True):
            worst = max(worst, float((p.grad - q.grad).abs().max()))
    return worst


@pytest.mark.parametrize("calls", [1, 2], ids=["one call", "two calls a step"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_whole_model_checkpointed_equals_dense_from_its_first_step(reentrant, calls):
    """Its recomputation must save what the forward it repeats saved: no rows go ahead
    in a forward under saved-tensor hooks (a checkpoint's), whose recomputation repeats it
    after later forwards learnt where rows could go."""
    assert max(run_distributed(_whole_model_checkpointed, 2, reentrant, calls,
                               timeout=T)) < 1e-10


class _InnerNonReentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: self.c2(self.c1(t).relu()), x, use_reentrant=False)


def _inner_non_reentrant():
    try:
        return check_or_error(_InnerNonReentrant, [5, 7], [5], None)
    except RuntimeError as e:  # raised in the backward pass, where it recomputes
        return str(e)


def test_a_non_reentrant_checkpoint_inside_is_refused_naming_it():
    for out in run_distributed(_inner_non_reentrant, 2, timeout=T):
        assert isinstance(out, str) and "checkpoint" in out, out
