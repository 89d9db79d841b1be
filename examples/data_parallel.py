"""Data-parallel training with tensorpar.nn.DataParallel, checked against one process.

    torchrun --nproc-per-node 2 examples/data_parallel.py

Each rank trains on its own slice of every batch; the gradients are averaged in buckets
while backward runs. With gradient accumulation (no_sync) over 2 micro-batches, the result
equals training on the whole batch in one process.
"""

import torch
import torch.distributed as dist
from torch import nn

import tensorpar


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tensorpar.nn.DataParallel(make_model(), bucket_cap_mb=0.0002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(12, 16, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(-1, keepdim=True).sin()

    for step, (x, y) in enumerate(zip(data, target, strict=True)):
        rows = torch.tensor_split(torch.arange(len(x)), world)[rank]
        halves = torch.tensor_split(rows, 2)  # two micro-batches per rank
        for i, part in enumerate(halves):
            share = len(part) / len(x) * world  # so the average over ranks is the full mean
            if i == 0:
                with model.no_sync():
                    (nn.functional.mse_loss(model(x[part]), y[part]) * share).backward()
            else:
                (nn.functional.mse_loss(model(x[part]), y[part]) * share).backward()
        opt.step()
        opt.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0 and step % 4 == 0:
            print(f"step {step}: full-batch loss {loss.item():.4f}")
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(model.module.parameters(), reference.parameters(), strict=True))
    reducer = model.reducer
    print(f"rank {rank}: matches single-process training: {same}; {len(reducer.buckets)} "
          f"buckets, {reducer.bytes_reduced} bytes reduced in {reducer.iterations} syncs")
    dist.barrier()  # every rank done communicating before any rank tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
