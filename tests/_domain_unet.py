"""A small 2-D U-Net for the domain-parallel tests and the example (dense code, no tensorpar)."""

import torch
from torch import nn


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU())


class SmallUNet(nn.Module):
    """Two levels down (max pooling, strided conv), two up (transposed conv, up-sampling)."""

    def __init__(self, cin: int = 1, cout: int = 1, width: int = 4) -> None:
        super().__init__()
        w = width
        self.enc1 = block(cin, w)
        self.pool = nn.MaxPool2d(2)
        self.enc2 = block(w, 2 * w)
        self.down = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)
        self.mid = block(2 * w, 4 * w)
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.dec2 = block(4 * w, 2 * w)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear")
        self.dec1 = block(3 * w, w)
        self.out = nn.Conv2d(w, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)                      # (B, w, H, W)
        e2 = self.enc2(self.pool(e1))          # (B, 2w, H/2, W/2)
        m = self.mid(self.down(e2))            # (B, 4w, H/4, W/4)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(d1)                    # (B, cout, H, W)
