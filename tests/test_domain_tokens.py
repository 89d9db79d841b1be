"""A tile reshaped into tokens (``x.flatten(2).transpose(1, 2)``): calls over the channels
equal dense; a reduction along the tokens (other than a sum or a mean over all of them:
`test_domain_reductions`) and attention written by hand (two tiles' points paired) are
refused on every rank, also with an empty tile (linear attention, a sum over the points:
`test_domain_contractions`)."""

import pytest
import torch
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300


class TokenMixer(nn.Module):
    """A per-point MLP and a softmax over channels on the tokens, then back to the image."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.mlp, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        tokens = y.flatten(2).transpose(1, 2)  # (B, h * w, C)
        tokens = tokens + torch.softmax(self.mlp(self.norm(tokens)), dim=-1)
        heads = tokens.reshape(b, h * w, 2, c // 2).sum(-1)  # a split of the channels
        return self.out(tokens.transpose(1, 2).reshape(b, c, h, w) + heads.mean(-1)[:, None]
                        .reshape(b, 1, h, w))


def _mixer(sizes):
    return check(TokenMixer, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


def test_calls_over_the_channels_of_tokens_equal_dense():
    assert max(run_distributed(_mixer, 2, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_mixer, 3, [3, 0, 4], timeout=T)) < 1e-10


class HandAttention(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv, self.qkv = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        tokens = y.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        if self.how == "scores":  # softmax(q k^T) v
            return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        if self.how == "token_max":  # along the points, with the tile's indices
            return y.flatten(2).max(-1).values
        return torch.softmax(y.flatten(2), dim=-1)  # along the points


def _refused(how, sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(HandAttention(how), dims=-2)
    x = torch.randn(1, 2, sizes[torch.distributed.get_rank()], 6)
    with pytest.raises(ValueError, match="points"):
        model(x)
    return True


@pytest.mark.parametrize("how", ["scores", "token_max", "token_softmax"])
def test_reductions_and_attention_along_the_tokens_are_refused(how):
    assert all(run_distributed(_refused, 2, how, [4, 3], timeout=T))
    assert all(run_distributed(_refused, 3, how, [3, 0, 4], timeout=T))


class ChannelsLast(nn.Module):
    """ConvNeXt's way: the tile permuted to channels-last for a LayerNorm and a linear
    layer over the channels, then back (the same number of dims, another layout)."""

    def __init__(self, softmax_over_rows: bool = False) -> None:
        super().__init__()
        self.softmax_over_rows = softmax_over_rows
        self.conv, self.out = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)
        self.norm, self.mlp = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)  # (B, H, W, C)
        y = self.mlp(self.norm(y))
        if self.softmax_over_rows:  # dim 1 holds the split rows here
            y = torch.softmax(y, dim=1)
        return self.out(y.permute(0, 3, 1, 2))


def _channels_last(sizes):
    return check(ChannelsLast, (2, 2, sum(sizes), 6), (-2,), (sizes,), steps=2)


def test_a_channels_last_block_equals_dense():
    assert max(run_distributed(_channels_last, 2, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_channels_last, 3, [3, 0, 4], timeout=T)) < 1e-10


def _rows_softmax():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(ChannelsLast(softmax_over_rows=True), dims=-2)
    with pytest.raises(ValueError, match="points"):
        model(torch.randn(1, 2, 4 + torch.distributed.get_rank(), 6))
    return True


def test_a_softmax_over_the_rows_of_a_permuted_tile_is_refused():
    assert all(run_distributed(_rows_softmax, 2, timeout=T))
