"""A data-parallel axis beside the domain axis: (replicas x tiles) on a 2-D mesh.

Each replica trains on its own batch, split over its domain group; the reducer (the DDP
wrapper or `BucketedAllReduce` on the replica group) sums the tiles' partial gradients and
averages the replicas in one all-reduce per bucket; or FSDP2 (`fully_shard_domain`) shards
the parameters over the replicas and sums over the domain in its hybrid reduction.
Reference: the dense model's gradient on each replica's whole batch, averaged, and the
SGD-with-momentum steps it gives.
"""

import contextlib
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
    """Convolutions on tiles, then a head on the globally pooled (replicated) features.

    Parameters are used after the pooling in every way a model does: a head module's own
    and its children's (with an in-place activation between them), one of a module whose
    forward holds the pooling itself, and one of the model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.pooled = _ConvPoolScale()
        self.head = _Head()
        self.out_scale = nn.Parameter(torch.tensor([0.7]))  # (FSDP2 refuses 0-d parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(self.body(x))) * self.out_scale


class _ConvPoolScale(nn.Module):
    """A convolution (before the pooling) and a scale (after it) in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x)).flatten(1) * self.scale


class _Head(nn.Module):
    """Parameters of its own and in children: each gradient must be counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.tensor([0.1, 0.2, -0.3, 0.4]))
        self.mlp = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.shift)


MODELS = {"unet": (SmallUNet, (2, 1, 16, 12)), "pooled": (PooledHead, (3, 1, 11, 6))}


def _train(model_name, wrapper, splits, steps=3, w_splits=None):
    """``splits[r]``: replica r's rows per tile; ``w_splits[r]``: its columns (2-D tiles)."""
    from torch.distributed.device_mesh import init_device_mesh

    import tensorpar
    from tensorpar.nn import DistributedDataParallel, parallelize_domain

    build, shape = MODELS[model_name]
    replicas = len(splits)
    grid = (len(splits[0]),) if w_splits is None else (len(splits[0]), len(w_splits[0]))
    names = ("domain",) if w_splits is None else ("h", "w")
    if wrapper.startswith("fsdp"):  # FSDP2's hybrid mesh: the domain first, then replicas
        mesh = init_device_mesh("cpu", (*grid, replicas), mesh_dim_names=(*names, "dp"))
        *tile, r = mesh.get_coordinate()
    else:
        mesh = init_device_mesh("cpu", (replicas, *grid), mesh_dim_names=("dp", *names))
        r, *tile = mesh.get_coordinate()
    t = tile[0]
    torch.manual_seed(0)
    dense = build().double()
    par_model = parallelize_domain(copy.deepcopy(dense), dims=-2 if w_splits is None
                                   else (-2, -1), group=mesh[names if w_splits else names[0]])
    if wrapper == "fsdp_plain":  # FSDP2 on the replicas alone would never sum the tiles
        from torch.distributed.fsdp import fully_shard

        fully_shard(par_model, mesh=mesh["dp"])
        with pytest.raises(ValueError, match="fully_shard_domain"):
            par_model(batch_tile(shape, splits, r, t))
        return 0.0
    if wrapper == "fsdp_plain_outer":  # a module holding the domain model: refused too
        from torch.distributed.fsdp import fully_shard

        outer = nn.Sequential(par_model)
        fully_shard(outer, mesh=mesh["dp"])
        with pytest.raises(ValueError, match="fully_shard_domain"):
            outer(batch_tile(shape, splits, r, t))
        return 0.0
    if wrapper == "fsdp_plain_blocks":  # the blocks alone, on the replicas alone: refused
        from torch.distributed.fsdp import fully_shard

        for name in ("enc1", "enc2", "mid", "dec2", "dec1"):
            fully_shard(getattr(par_model, name), mesh=mesh["dp"])
        with pytest.raises(ValueError, match="fully_shard_domain"):
            par_model(batch_tile(shape, splits, r, t))
        return 0.0
    if wrapper == "fsdp_blocks":  # each block sharded on its own, then the root
        from torch.distributed.fsdp import fully_shard

        from tensorpar.nn import fully_shard_domain

        blocks = [getattr(par_model, n) for n in ("enc1", "enc2", "mid", "dec2", "dec1")]
        by_hand = copy.deepcopy(dense)  # (sharded by hand: refused, with the way to do it)
        by_hand = parallelize_domain(by_hand, dims=-2, group=mesh["domain"])
        fully_shard(by_hand.enc1, mesh=mesh)
        with pytest.raises(ValueError, match="blocks="):
            fully_shard_domain(by_hand, mesh=mesh)
        # (given twice, and a block inside another: each sharded once, the inner one first)
        par = fully_shard_domain(par_model, mesh=mesh,
                                 blocks=[blocks[0], *blocks, blocks[1], par_model.dec1[0]])
    elif wrapper == "fsdp":
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
        if w_splits is not None:
            cols = w_splits[r]
            mine = mine.narrow(-1, sum(cols[:tile[1]]), cols[tile[1]])
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


@pytest.mark.slow
@pytest.mark.parametrize(("model", "wrapper"), [("unet", "ddp"), ("unet", "fsdp"),
                                                ("pooled", "fsdp")])
def test_two_by_two_tiles_two_replicas_equal_dense(model, wrapper):
    # 8 ranks: 2 replicas of 2 x 2 tiles, uneven along both dims
    splits = {"unet": ([[9, 7], [6, 10]], [[5, 7], [7, 5]]),
              "pooled": ([[5, 6], [4, 7]], [[2, 4], [3, 3]])}[model]
    assert max(run_distributed(_train, 8, model, wrapper, splits[0], 3, splits[1],
                               timeout=T)) < TOL


@pytest.mark.parametrize("wrapper", ["ddp", "reducer"])
def test_one_replica_whose_reduction_spans_the_domain_group_equals_dense(wrapper):
    # the reducer's group (replicas x tiles) has the domain group's ranks: its bucket
    # all-reduces, launched while the backward runs, must not share a process group with
    # the domain's own exchanges (the ranks launch them between other exchanges)
    assert max(run_distributed(_train, 3, "unet", wrapper, [[6, 5, 5]], timeout=90)) < TOL


def test_plain_fsdp_beside_the_domain_is_refused():
    run_distributed(_train, 4, "unet", "fsdp_plain", [[9, 7], [16, 0]], timeout=T)


def test_blocks_sharded_by_fully_shard_domain_equal_dense_and_by_hand_are_refused():
    assert max(run_distributed(_train, 4, "unet", "fsdp_blocks", [[9, 7], [16, 0]],
                               timeout=T)) < TOL


@pytest.mark.parametrize("wrapper", ["fsdp_plain_blocks", "fsdp_plain_outer"])
def test_plain_fsdp_on_blocks_or_on_a_module_holding_the_model_is_refused(wrapper):
    run_distributed(_train, 4, "unet", wrapper, [[9, 7], [16, 0]], timeout=T)


def _fully_shard_domain_refusals():
    from torch.distributed.device_mesh import init_device_mesh

    from tensorpar.nn import fully_shard_domain, parallelize_domain

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("domain", "dp"))
    strips = parallelize_domain(SmallUNet().double(), dims=-2, group=mesh["domain"])
    with pytest.raises(ValueError, match="needs 2 dims"):
        fully_shard_domain(strips, mesh=mesh["domain"])
    wrong = parallelize_domain(SmallUNet().double(), dims=-2, group=mesh["dp"])
    with pytest.raises(ValueError, match="domain group 0 has ranks"):
        fully_shard_domain(wrong, mesh=mesh)
    with pytest.raises(ValueError, match="not converted by parallelize_domain"):
        fully_shard_domain(SmallUNet(), mesh=mesh)
    with pytest.raises(ValueError, match="the model itself is not one of its blocks"):
        fully_shard_domain(strips, mesh=mesh, blocks=[strips.enc1, strips])
    with pytest.raises(ValueError, match="not a submodule"):
        fully_shard_domain(strips, mesh=mesh, blocks=[nn.Conv2d(1, 1, 1)])
    fully_shard_domain(strips, mesh=mesh, blocks=[strips.enc1])
    with pytest.raises(ValueError, match="already sharded by fully_shard_domain"):
        fully_shard_domain(strips, mesh=mesh)
    # tiles on a slice of a larger mesh: flattening it would make groups some ranks skip
    root = init_device_mesh("cpu", (2, 1, 2, 1), mesh_dim_names=("pp", "h", "w", "dp"))
    tiles = parallelize_domain(SmallUNet().double(), dims=(-2, -1), group=root["h", "w"])
    with pytest.raises(ValueError, match="mesh over every rank"):
        fully_shard_domain(tiles, mesh=root["h", "w", "dp"])
    return True


def test_fully_shard_domain_refuses_a_mesh_that_does_not_fit():
    assert all(run_distributed(_fully_shard_domain_refusals, 4, timeout=T))


# -- what .grad already holds: summed over the replicas' average, never over the tiles ------

class _Branches(nn.Module):
    """Three convolutions; the middle one is left out where ``skip`` holds for the step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.out = nn.Conv2d(2, 1, 3, padding=1)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.out(h if self.skip else h + self.b(h))


# each step: its backward passes, (synchronised?, replicas that leave ``b`` out)
PATTERNS = {
    "two synchronised backwards": [[(True, ()), (True, ())]],
    "steps without zero_grad": [[(True, ())], [(True, ())]],
    "no_sync after a synchronised step": [[(True, ())], [(False, ()), (True, ())]],
    "a gradient left from before": "left over",
    "an unused parameter keeps its sum": [[(True, ())], [(True, (0, 1))], [(True, (0,))]],
}


def _accumulated(wrapper, pattern, views):
    from torch.distributed.device_mesh import init_device_mesh

    import tensorpar
    from tensorpar.nn import DistributedDataParallel, parallelize_domain

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "domain"))
    r, t = mesh.get_coordinate()
    torch.manual_seed(0)
    dense = _Branches().double()
    par_model = parallelize_domain(copy.deepcopy(dense), dims=-2, group=mesh["domain"])
    steps = PATTERNS[pattern]
    if steps == "left over":  # .grad holds something before the reducer is built
        for p, q in zip(par_model.parameters(), dense.parameters(), strict=True):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        steps = [[(True, ())]]
    options = {"find_unused_parameters": pattern.startswith("an unused"),
               "gradient_as_bucket_view": views}
    if wrapper == "ddp":
        par = DistributedDataParallel(par_model, process_group=mesh.get_group("dp"), **options)
    else:
        reducer = tensorpar.BucketedAllReduce(par_model, group=mesh.get_group("dp"), **options)
        par = par_model
    worst = 0.0
    for s, backwards in enumerate(steps):
        for m, (synced, skipping) in enumerate(backwards):
            gen = torch.Generator().manual_seed(10 * s + m)
            batches = [torch.randn(2, 1, 9, 5, dtype=torch.float64, generator=gen)
                       for _ in range(2)]
            for replica, b in enumerate(batches):  # dense: the replicas' average
                dense.skip = replica in skipping
                (dense(b).square().sum() / 2).backward()
            par_model.skip = r in skipping
            owner = par if wrapper == "ddp" else reducer
            with owner.no_sync() if not synced else contextlib.nullcontext():
                par(batches[r].tensor_split(2, -2)[t]).square().sum().backward()
        for p, q in zip(par_model.parameters(), dense.parameters(), strict=True):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    dist.barrier()
    return worst


@pytest.mark.parametrize("views", [True, False], ids=["views", "copies"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("wrapper", ["ddp", "reducer"])
def test_what_grad_holds_is_not_summed_over_the_tiles(wrapper, pattern, views):
    """Accumulation without no_sync, steps without zero_grad, a gradient from before: the
    reducer's one all-reduce over replicas x tiles must count what .grad held once."""
    assert max(run_distributed(_accumulated, 4, wrapper, pattern, views, timeout=120)) < TOL


def _comm_hook_refused():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh

    import tensorpar
    from tensorpar.errors import ReducerError
    from tensorpar.nn import parallelize_domain

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "domain"))
    model = parallelize_domain(_Branches().double(), dims=-2, group=mesh["domain"])
    reducer = tensorpar.BucketedAllReduce(model, group=mesh.get_group("dp"))
    try:
        reducer.register_comm_hook(None, default_hooks.allreduce_hook)
    except ReducerError as e:
        return str(e)
    return "registered"


def test_a_comm_hook_on_a_domain_model_is_refused():
    """A hook divides by its own group: none sums over the tiles and averages over the
    replicas (torch's allreduce_hook gave half the gradients, or each tile's share)."""
    for message in run_distributed(_comm_hook_refused, 4, timeout=120):
        assert "domain" in message, message
