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
