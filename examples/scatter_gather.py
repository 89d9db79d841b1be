"""Scatter a batch from rank 0, compute on every rank, gather the result and train.

Run on CPU with gloo (any number of processes, e.g. 3, which splits 10 rows unevenly):

    torchrun --nproc-per-node 3 examples/scatter_gather.py

Only rank 0 holds the data and computes the loss; every other rank holds a
TensorPlaceholder and joins the backward pass through it.
"""

import torch
import torch.distributed as dist

import tensorpar


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    data = torch.randn(10, 4) if rank == 0 else None
    target = torch.randn(10, 4) if rank == 0 else None
    # Every rank knows what rank 0 will send: build the placeholder once, reuse it every step.
    batch = data if rank == 0 else tensorpar.TensorPlaceholder((10, 4), torch.float32, owner=0)

    for step in range(5):
        rows = tensorpar.scatter(batch, src=0, exchange_meta=False)      # (10/world, 4) here
        out = tensorpar.gather(layer(rows), dst=0)                        # (10, 4) on rank 0
        if tensorpar.is_placeholder(out):
            out.backward()                  # joins rank 0's backward; fills layer's grads
        else:
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            print(f"step {step}: loss {loss.item():.4f} (rows per rank: "
                  f"{[len(c) for c in torch.tensor_split(torch.empty(10), world)]})")
        for p in layer.parameters():        # each rank has the grad of its own rows: sum them
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    if rank == 0:  # the same 5 steps on one process give the same weights
        torch.manual_seed(0)
        dense = torch.nn.Linear(4, 4)
        dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
        for _ in range(5):
            torch.nn.functional.mse_loss(dense(data), target).backward()
            dense_opt.step()
            dense_opt.zero_grad()
        same = torch.allclose(dense.weight, layer.weight, atol=1e-6)
        print(f"weights match single-process training: {same}")
    else:
        print(f"rank {rank} held {out}")
    dist.barrier()  # every rank done communicating before any rank tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
