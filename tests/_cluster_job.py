"""Runs on every rank of a simulated 2 x 2 cluster (see test_cluster.py); prints OK."""

import os

import torch
import torch.distributed as dist

from tensorpar.hierarchical import hierarchical_all_reduce
from tensorpar.hierarchical.topology import Topology
from tensorpar.testing.cluster import link_bytes


def _sent_per_call(fn):
    """Bytes this machine sent over its link during fn() (kernel counters)."""
    dist.barrier()
    before = link_bytes()[0]
    dist.barrier()  # every rank of the machine has read the counter before anyone sends
    fn()
    dist.barrier()
    return link_bytes()[0] - before


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = Topology.detect()
    assert str(topo) == "2 machines x 2 ranks", topo
    assert topo.machine == int(os.environ["GROUP_RANK"]), (topo, os.environ["GROUP_RANK"])
    for n in (0, 1, 3, 7, 99991, 2**20):
        for dtype in (torch.float32, torch.bfloat16):
            for op in ("sum", "mean"):
                g = torch.Generator().manual_seed(1000 * rank + n)
                x = torch.randint(-8, 9, (n,), generator=g).to(dtype)
                flat = x.clone()
                if op == "mean":
                    flat.div_(4)
                dist.all_reduce(flat)
                hierarchical_all_reduce(x, topo, op=op, slice_bytes=256 * 1024)
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                assert torch.equal(x.view(bits), flat.view(bits)), (n, dtype, op)
    x = torch.ones(2**20)
    flat_sent = _sent_per_call(lambda: dist.all_reduce(x))
    hier_sent = _sent_per_call(lambda: hierarchical_all_reduce(x, topo))
    print(f"OK rank {rank} machine {topo.machine} sent_ratio {hier_sent / flat_sent:.3f}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
