"""Rank 0 holds a large 2-D field; every rank processes some of its rows; rank 0 takes the loss.

    torchrun --nproc-per-node 3 examples/placeholder_field.py

This is the workflow placeholders exist for. Only rank 0 has the data (say, a simulation
snapshot it loaded). `scatter` splits the field's rows across the ranks (unevenly when they do
not divide), each rank runs the model on its rows, and `gather` brings the result back to
rank 0, which computes the loss. The other ranks get a `TensorPlaceholder` from `gather`, and
call `.backward()` on it: that joins the backward scatter, so their share of the gradient
arrives without any of them knowing the loss. The model (a learned stencil along each row)
is replicated, so its gradients are summed across the ranks.

The check at the end: the learned stencil equals the one a single process learns from the
whole field.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar


def make_field(rows, cols):
    """A field (a few Gaussian blobs and noise) and its state after one step of diffusion."""
    g = torch.Generator().manual_seed(0)
    y, x = torch.meshgrid(torch.linspace(-1, 1, rows), torch.linspace(-1, 1, cols),
                          indexing="ij")
    field = torch.zeros(rows, cols)
    for cy, cx, width in torch.rand(6, 3, generator=g).tolist():
        field += torch.exp(-((y - 2 * cy + 1) ** 2 + (x - 2 * cx + 1) ** 2) / (0.02 + 0.1 * width))
    field += 0.3 * torch.randn(rows, cols, generator=g)
    laplacian = F.pad(field, (1, 1), mode="replicate").unfold(1, 3, 1) @ torch.tensor(
        [1.0, -2.0, 1.0])
    return field, field + 0.2 * laplacian


class Stencil(nn.Module):
    """A learned 3-point stencil applied along every row (rows are independent)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 3, padding=1, padding_mode="replicate")

    def forward(self, rows):                                # (R, C) -> (R, C)
        return self.conv(rows.unsqueeze(1)).squeeze(1)


def train(model, steps, lr, field, target, distributed):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        rows = tensorpar.scatter(field, dim=0, src=0) if distributed else field
        out = tensorpar.gather(model(rows), dim=0, dst=0) if distributed else model(rows)
        if tensorpar.is_placeholder(out):
            out.backward()                                  # joins rank 0's backward
        else:
            loss = F.mse_loss(out, target)
            loss.backward()
            if distributed and step % 50 == 0:
                print(f"step {step:3d}  loss {loss.item():.3e}", flush=True)
        opt.step()
        opt.zero_grad()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1001, help="uneven on most rank counts")
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    device = tensorpar.init_distributed()  # survives torchrun --max-restarts
    rank, world = dist.get_rank(), dist.get_world_size()

    if rank == 0:
        field, target = (t.to(device) for t in make_field(args.rows, args.cols))
    else:  # what rank 0 will send, without the data: the same placeholder every step
        field = tensorpar.TensorPlaceholder((args.rows, args.cols), torch.float32,
                                            device=device, owner=0)
        target = None
    torch.manual_seed(0)
    model = Stencil().to(device)
    # the stencil is replicated: sum (not average) the gradients of every rank's rows
    tensorpar.BucketedAllReduce(model, average=False)
    sizes = [len(c) for c in torch.tensor_split(torch.empty(args.rows), world)]
    if rank == 0:
        print(f"{args.rows} rows on {world} ranks: {sizes} rows each", flush=True)
    train(model, args.steps, args.lr, field, target, distributed=True)

    if rank == 0:
        torch.manual_seed(0)
        reference = Stencil().to(device)
        train(reference, args.steps, args.lr, field, target, distributed=False)
        learned = torch.cat([p.detach().flatten() for p in model.parameters()])
        expected = torch.cat([p.detach().flatten() for p in reference.parameters()])
        diff = (learned - expected).abs().max().item()
        ok = diff < 1e-4
        print(f"stencil {[round(v, 3) for v in learned.tolist()]} (one diffusion step is "
              f"[0.2, 0.6, 0.2], bias 0)")
        print(f"check: largest difference from one process learning on the whole field "
              f"{diff:.1e} (< 1e-4): {'OK' if ok else 'FAILED'}", flush=True)
    else:
        ok = True
    verdict = torch.tensor([int(ok)], device=device)
    dist.broadcast(verdict, 0)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if verdict.item() else 1)


if __name__ == "__main__":
    main()
