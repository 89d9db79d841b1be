"""Attention along an axis that is not split (per-pixel attention over a video's frames,
the pixels split over the ranks): every pixel's attention is on its own rank, and it
equals dense; attention whose sequence holds the split points is refused."""

import pytest
import torch
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(600)
T = 300


class FrameAttention(nn.Module):
    """A video (B, C, T, H, W): a 3-D convolution, attention over the frames at each
    pixel (``nn.MultiheadAttention``, batch first), another convolution."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.conv, self.out = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.qkv = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, t, h, w = y.shape
        frames = y.permute(0, 3, 4, 2, 1).reshape(b * h * w, t, c)  # (pixels, frames, C)
        if self.functional:
            q, k, v = self.qkv(frames).view(b * h * w, t, 3, 2, 2).permute(2, 0, 3, 1, 4)
            mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            mixed = mixed.transpose(1, 2).reshape(b * h * w, t, c)
        else:
            mixed, _ = self.attn(frames, frames, frames, need_weights=False)
        back = mixed.reshape(b, h, w, t, c).permute(0, 4, 3, 1, 2)
        return self.out(y + back)


def _frames(functional, sizes):
    return check(lambda: FrameAttention(functional), (2, 2, 3, sum(sizes), 5), (-2,),
                 (sizes,), steps=2)


@pytest.mark.parametrize("functional", [False, True])
def test_attention_over_the_frames_of_each_pixel_equals_dense(functional):
    assert max(run_distributed(_frames, 2, functional, [4, 3], timeout=T)) < 1e-10
    assert max(run_distributed(_frames, 3, functional, [3, 0, 4], timeout=T)) < 1e-10


class PixelAttention(FrameAttention):
    """Attention over the pixels of each frame: its sequence holds the split rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, t, h, w = y.shape
        pixels = y.permute(0, 2, 3, 4, 1).reshape(b * t, h * w, c)
        mixed, _ = self.attn(pixels, pixels, pixels, need_weights=False)
        return mixed


def _pixels(sizes):
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(PixelAttention(), dims=-2)
    with pytest.raises(RuntimeError, match="this tile's points only"):
        model(torch.randn(1, 2, 3, sizes[torch.distributed.get_rank()], 5))
    return True


def test_attention_over_the_split_pixels_is_refused():
    assert all(run_distributed(_pixels, 2, [4, 3], timeout=T))
    assert all(run_distributed(_pixels, 3, [3, 0, 4], timeout=T))
