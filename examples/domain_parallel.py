"""Train a small U-Net on a 2-D field split over 4 ranks (domain parallelism).

    torchrun --nproc-per-node 4 examples/domain_parallel.py --tiles strips
    torchrun --nproc-per-node 4 examples/domain_parallel.py --tiles 2x2 --plot field.png

The problem: learn a nonlinear stencil operator, target = tanh(5 * laplacian(u)) + u, from
random smooth fields u. The fields are generated on rank 0 only: each batch goes out with
`tensorpar.scatter` (the other ranks pass None), in 4 strips along H or, on a 2 x 2 mesh,
first along H, then along W. Each rank runs the converted U-Net on its tile; the loss is a
mean over the whole domain (`domain_mean`, nothing gathered). At the end rank 0 trains the
same dense model in one process on the same data and checks that the weights agree, then
gathers one prediction with `tensorpar.gather` and plots it.
"""

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

import tensorpar
from tensorpar.nn import domain_layout, domain_mean, parallelize_domain


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, w: int = 8) -> None:
        super().__init__()
        self.enc1, self.pool, self.enc2 = block(1, w), nn.MaxPool2d(2), block(w, 2 * w)
        self.down = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)
        self.mid = block(2 * w, 4 * w)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), block(4 * w, 2 * w)
        self.up1, self.dec1 = nn.Upsample(scale_factor=2, mode="bilinear"), block(3 * w, w)
        self.out = nn.Conv2d(w, 1, 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(u)                                       # (B, w, H, W)
        e2 = self.enc2(self.pool(e1))                           # (B, 2w, H/2, W/2)
        m = self.mid(self.down(e2))                             # (B, 4w, H/4, W/4)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        return self.out(self.dec1(torch.cat([self.up1(d2), e1], 1)))


def fields(step: int, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random smooth periodic fields and their targets (generated on rank 0 only)."""
    g = torch.Generator().manual_seed(step)
    y, x = torch.meshgrid(torch.linspace(0, 2 * torch.pi, size + 1)[:-1],
                          torch.linspace(0, 2 * torch.pi, size + 1)[:-1], indexing="ij")
    u = torch.zeros(batch, 1, size, size, dtype=torch.float64)
    for _ in range(4):
        k = torch.randint(1, 4, (2,), generator=g)
        a = torch.randn(batch, 1, 1, 1, generator=g, dtype=torch.float64)
        p = torch.rand(1, generator=g)
        u += a * torch.sin(k[0] * y + k[1] * x + 2 * torch.pi * p)
    lap = sum(torch.roll(u, s, d) for s in (1, -1) for d in (2, 3)) - 4 * u
    return u, torch.tanh(5 * lap) + u


def split_sizes(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


class Tiles:
    """Where this rank's tile is, and how a field on rank 0 goes out and comes back."""

    def __init__(self, kind: str, size: int) -> None:
        self.rank, self.kind = dist.get_rank(), kind
        if kind == "strips":
            self.mesh = None
            self.groups = [dist.group.WORLD]
            self.coords = [self.rank]
            self.splits = [split_sizes(size, dist.get_world_size())]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh("cpu", (2, 2))
            self.groups = [self.mesh.get_group(0), self.mesh.get_group(1)]
            self.coords = list(self.mesh.get_coordinate())
            self.splits = [split_sizes(size, 2), split_sizes(size, 2)]

    def scatter(self, full: torch.Tensor | None) -> torch.Tensor:
        x = full
        for i, (group, sizes) in enumerate(zip(self.groups, self.splits, strict=True)):
            # stage i: the ranks holding data so far hand each one of their group its rows
            if all(c == 0 for c in self.coords[i + 1:]):
                x = tensorpar.scatter(x, dim=2 + i, src=0, group=group, sizes=sizes)
        assert x is not None
        return x

    def gather(self, tile: torch.Tensor, splits: list[list[int]]) -> torch.Tensor | None:
        x: torch.Tensor | None = tile
        for i in reversed(range(len(self.groups))):
            if all(c == 0 for c in self.coords[i + 1:]):
                assert x is not None
                out = tensorpar.gather(x, dim=2 + i, dst=0, group=self.groups[i],
                                       sizes=splits[i])
                x = None if tensorpar.is_placeholder(out) else out  # type: ignore[assignment]
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", choices=["strips", "2x2"], default="strips")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    tensorpar.init_distributed(backend="gloo")  # survives torchrun --max-restarts
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit("run with --nproc-per-node 4")
    torch.manual_seed(0)
    dense = UNet().double()
    tiles = Tiles(args.tiles, args.size)
    model = parallelize_domain(copy.deepcopy(dense), dims=(-2, -1)[:len(tiles.groups)],
                               group=tiles.mesh if tiles.mesh is not None else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for step in range(args.steps):
        u, target = fields(step, args.batch, args.size) if rank == 0 else (None, None)
        tile, goal = tiles.scatter(u), tiles.scatter(target)
        loss = domain_mean((model(tile) - goal) ** 2,
                           group=tiles.mesh if tiles.mesh is not None else None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    # one prediction, gathered to rank 0
    u, target = fields(10_000, 1, args.size) if rank == 0 else (None, None)
    model.eval()
    with torch.no_grad():
        pred_tile = model(tiles.scatter(u))
    layout = domain_layout(model)
    pred = tiles.gather(pred_tile, [layout[i][args.size] for i in range(len(tiles.groups))])
    if rank == 0:
        check_against_dense(dense, model, args, losses)
        if args.plot:
            plot(args.plot, u, target, pred, losses)
    dist.destroy_process_group()


def check_against_dense(dense: nn.Module, model: nn.Module, args: argparse.Namespace,
                        losses: list[float]) -> None:
    """One process trains the dense model on the same data: the weights must agree."""
    opt = torch.optim.SGD(dense.parameters(), lr=0.02, momentum=0.9)
    for step in range(args.steps):
        u, target = fields(step, args.batch, args.size)
        loss = ((dense(u) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(loss.item() - losses[step]) < 1e-9, (step, loss.item(), losses[step])
    dp = dict(dense.named_parameters())
    diff = max(float((p - dp[n]).abs().max()) for n, p in model.named_parameters())
    print(f"final loss {losses[-1]:.5f} (first {losses[0]:.5f}); max |weight - dense| = "
          f"{diff:.2e}")
    assert diff < 1e-9, diff
    print(f"OK: {args.tiles} tiles train like one process")


def plot(path: str, u: torch.Tensor | None, target: torch.Tensor | None,
         pred: torch.Tensor | None, losses: list[float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    assert u is not None and target is not None and pred is not None
    fig, ax = plt.subplots(1, 4, figsize=(14, 3.2))
    for a, (title, img) in zip(ax[:3], [("input u", u), ("target", target),
                                         ("prediction (gathered)", pred)], strict=True):
        a.imshow(img[0, 0].numpy(), cmap="RdBu_r")
        a.set_title(title)
        a.axis("off")
    ax[3].semilogy(losses)
    ax[3].set_title("training loss (domain mean)")
    ax[3].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
