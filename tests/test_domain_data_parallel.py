"""A data-parallel axis beside the domain axis: (replicas x tiles) on a 2-D mesh.

Each replica trains on its own batch, split over its domain group; the reducer (the DDP
wrapper or `BucketedAllReduce` on the replica group) sums the tiles' partial gradients and
averages the replicas in one all-reduce per bucket; or FSDP2 (`fully_shard_domain`) shards
the parameters over the replicas and sums over the domain in its hybrid reduction.
Reference: the dense model's gradient on each replica's whole batch, averaged, and the
SGD-with-momentum steps it gives.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_unet import SmallUNet

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


class PooledHead(nn.Module):
    """Convolutions on tiles, then a head on the globally pooled (replicated) features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                                  nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.body(x)).flatten(1))


class _Head(nn.Module):
    """Parameters of its own and in children: each gradient must be counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0, 1.0]))
        self.mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x * self.scale)


MODELS = {"unet": (SmallUNet, (2, 1, 16, 12)), "pooled": (PooledHead, (3, 1, 11, 6))}


def _train(model_name, wrapper, splits, steps=3):
    from torch.distributed.device_mesh import init_device_mesh

    import tensorpar
    from tensorpar.nn import DistributedDataParallel, parallelize_domain

    build, shape = MODELS[model_name]
    replicas, tiles = 2, len(splits[0])
    if wrapper.startswith("fsdp"):  # FSDP2's hybrid mesh: the domain first, then replicas
        mesh = init_device_mesh("cpu", (tiles, replicas), mesh_dim_names=("domain", "dp"))
        t, r = mesh.get_coordinate()
    else:
        mesh = init_device_mesh("cpu", (replicas, tiles), mesh_dim_names=("dp", "domain"))
        r, t = mesh.get_coordinate()
    torch.manual_seed(0)
    dense = build().double()
    par_model = parallelize_domain(copy.deepcopy(dense), dims=-2, group=mesh["domain"])
    if wrapper == "fsdp_plain":  # FSDP2 on the replicas alone would never sum the tiles
        from torch.distributed.fsdp import fully_shard

        fully_shard(par_model, mesh=mesh["dp"])
        with pytest.raises(ValueError, match="fully_shard_domain"):
            par_model(batch_tile(shape, splits, r, t))
        return 0.0
    if wrapper == "fsdp":
        from tensorpar.nn import fully_shard_domain

        par = fully_shard_domain(par_model, mesh=mesh)
    elif wrapper == "ddp":
        par = DistributedDataParallel(par_model, process_group=mesh.get_group("dp"))
        with pytest.raises(ValueError, match="domain-parallel"):
            par.join()
    else:
        tensorpar.BucketedAllReduce(par_model, group=mesh.get_group("dp"),
                                    bucket_cap_mb=0.001)  # several buckets
        par = par_model
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(par_model.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        batches = [torch.randn(*shape, dtype=torch.float64, generator=gen)
                   for _ in range(replicas)]
        # dense: every replica's gradient on its whole batch, averaged
        opt_d.zero_grad()
        for b in batches:
            (dense(b).square().mean() / replicas).backward()
        sizes = splits[r]
        mine = batches[r].narrow(-2, sum(sizes[:t]), sizes[t])
        opt_p.zero_grad()
        out = par(mine)
        if model_name == "pooled":  # replicated output: every rank computes the whole loss
            part = out.square().mean()
        else:  # a mean over the whole field: this tile's share of the sum
            part = out.square().sum() / batches[r].numel()
        part.backward()
        for (name, p), q in zip(par_model.named_parameters(), dense.parameters(), strict=True):
            assert p.grad is not None, name
            worst = max(worst, (_full(p.grad) - q.grad).abs().max().item())
        opt_d.step()
        opt_p.step()
        for p, q in zip(par_model.parameters(), dense.parameters(), strict=True):
            worst = max(worst, (_full(p.detach()) - q).abs().max().item())
    dist.barrier()
    return worst


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2: a sharded DTensor


def batch_tile(shape, splits, r, t):
    sizes = splits[r]
    x = torch.randn(*shape, dtype=torch.float64)
    return x.narrow(-2, sum(sizes[:t]), sizes[t])


@pytest.mark.parametrize("wrapper", ["ddp", "reducer", "fsdp"])
def test_unet_two_replicas_of_two_tiles_equal_dense(wrapper):
    # replica 1 has an empty tile: its gradients arrive in another order
    assert max(run_distributed(_train, 4, "unet", wrapper, [[9, 7], [16, 0]],
                               timeout=T)) < TOL


@pytest.mark.parametrize("wrapper", ["reducer", "fsdp"])
def test_pooled_head_two_replicas_of_two_tiles_equal_dense(wrapper):
    # the head after global pooling holds the whole gradient on every tile: the reducer
    # divides it by the tiles; under FSDP2 its gradient enters the sum as a share
    assert max(run_distributed(_train, 4, "pooled", wrapper, [[5, 6], [1, 10]],
                               timeout=T)) < TOL


def test_plain_fsdp_beside_the_domain_is_refused():
    run_distributed(_train, 4, "unet", "fsdp_plain", [[9, 7], [16, 0]], timeout=T)
