"""Runs on every rank of a simulated 2 x 2 cluster (see test_cluster.py): the reducer with the
hierarchical algorithm against torch's DDP, step by step; prints OK with the largest gap.

The job ends the way a user's job does: tensorpar is not shut down by hand, so the test also
checks that its hierarchical engine lets the processes exit cleanly.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorpar as tp
from tensorpar.hierarchical.topology import Topology


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = Topology.detect()
    assert str(topo) == "2 machines x 2 ranks", topo
    # DDP gets a group of its own, released below while the interpreter runs normally. DDP
    # leaves its gloo work handles to gloo's worker threads, and a handle made in a backward
    # pass holds a Python object; a worker that frees one during interpreter finalization
    # aborts the process, and one that frees it while a group is destroyed under the GIL
    # deadlocks (torch's own, with or without tensorpar; destroy_process_group() keeps the
    # default group's workers alive until exit).
    ddp_group = dist.new_group()
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(64, 257), nn.Tanh(), nn.Linear(257, 33), nn.Tanh(),
                         nn.Linear(33, 5)).double()
    theirs = DDP(copy.deepcopy(ours), bucket_cap_mb=0.02, process_group=ddp_group)
    reducer = tp.BucketedAllReduce(ours, bucket_cap_mb=0.02, first_bucket_mb=0.01,
                                   algorithm="hierarchical", topology=topo)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    gap = 0.0
    with tp.CommCounter() as counter:
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 64, generator=g, dtype=torch.float64)
            for model in (ours, theirs):
                model(x).pow(2).mean().backward()
            gap = max([gap] + [(a.grad - b.grad).abs().max().item() for a, b in
                               zip(ours.parameters(), theirs.module.parameters(), strict=True)])
            for opt in opts:
                opt.step()
                opt.zero_grad()
    weights = max((a - b).abs().max().item()
                  for a, b in zip(ours.parameters(), theirs.module.parameters(), strict=True))
    print(f"OK rank {rank} buckets {len(reducer.buckets)} grad_gap {gap:.3g} "
          f"weight_gap {weights:.3g} inter_bytes {counter.nbytes(scope='inter')} "
          f"scatters {counter.count('reduce_scatter')}", flush=True)
    del theirs, opts, model
    dist.destroy_process_group(ddp_group)
    del ddp_group  # its last reference: gloo joins the group's workers here, GIL released
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
