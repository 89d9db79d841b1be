"""An ordinary DDP training script, with one line changed to use tensorpar's reducer.

    torchrun --nproc-per-node 2 examples/ddp_swap.py

`train()` below is a plain data-parallel loop written for PyTorch's DistributedDataParallel.
The only change is the line that wraps the model:

    model = DistributedDataParallel(model)          # before
    model = tensorpar.nn.DistributedDataParallel(model)        # after

The script trains the same model both ways on the same data, prints tensorpar's bucket layout
and how long the backward pass waited at its one synchronisation point, and checks that the
two runs end with the same weights.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tensorpar


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.LayerNorm(512), nn.Linear(512, 10))


def batches(steps, rank, device):
    """This rank's shard of every global batch (a DistributedSampler would do the same)."""
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g)
        yield x.to(device), (x[:, :10].sum(1) > 0).long().to(device)


def train(wrap, steps, device):
    model = wrap(make_model().to(device))                # <- the one line that differs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(steps, dist.get_rank(), device):
        loss = F.cross_entropy(model(x), y)
        loss.backward()                                   # gradients averaged in buckets here
        opt.step()
        opt.zero_grad()
    return model, loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.5)
    args = parser.parse_args()

    device = tensorpar.init_distributed()  # survives torchrun --max-restarts
    rank = dist.get_rank()
    ids = [device.index] if device.type == "cuda" else None

    ddp, ddp_loss = train(lambda m: DistributedDataParallel(
        m, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb), args.steps, device)
    ours, loss = train(lambda m: tensorpar.nn.DistributedDataParallel(
        m, bucket_cap_mb=args.bucket_cap_mb), args.steps, device)

    reducer = ours.reducer
    if rank == 0:
        print(f"tensorpar: {len(reducer.buckets)} buckets, in launch order:")
        for b in reducer.buckets:
            print(f"  bucket {b.index}: {b.nbytes / 2**20:.2f} MiB, {len(b.param_names)} "
                  f"parameters ({', '.join(b.param_names)})")
        print(f"waited {reducer.sync_wait_seconds * 1e3:.1f} ms in total at the end-of-backward "
              f"sync over {reducer.iterations} steps; final loss {loss:.4f} (DDP {ddp_loss:.4f})")
    diff = max((a - b).abs().max().item() for a, b in
               zip(ddp.module.parameters(), ours.module.parameters(), strict=True))
    worst = torch.tensor([diff], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() < 1e-5
    if rank == 0:
        print(f"check: largest weight difference from DDP after {args.steps} steps "
              f"{worst.item():.1e} (< 1e-5): {'OK' if ok else 'FAILED'}", flush=True)
    # torch's DDP holds the process group in its C++ reducer: released now, while the group is
    # still registered, the group is then torn down by destroy_process_group rather than at
    # interpreter exit, where joining gloo's worker threads can deadlock with them
    del ddp
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
