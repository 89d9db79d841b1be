"""Domain parallelism: a conv stack and a U-Net split in strips, against the ideal.

Workloads (float32, batch 1, one forward+backward per step, loss ``sum(out)``):

- ``conv8``: 8 x ``Conv2d(32, 32, 3, padding=1)`` on a ``size x size`` image;
- ``unet``: a 2-level U-Net (width 16: max pooling, strided conv, transposed conv, bilinear
  up-sampling, BatchNorm and GroupNorm, skip connections) on a ``size x size`` image.

Timed side by side on every rank (interleaved rounds, slowest rank, medians):

- ``domain``: the model converted by `tensorpar.nn.parallelize_domain`, on the rank's strip;
- ``ideal``: the same dense model on a strip of the rank's rows plus the halo rows of the
  first layer (one on each side that has a neighbour, for the conv stack; two on each side
  for the U-Net, which needs a multiple of 4 rows), with no communication at all. (It
  computes the halo rows' outputs too, so it does a little more arithmetic than the domain
  step.)
- ``floor`` (the U-Net): the ideal plus the exchanges any exact domain-parallel norm
  needs (its statistics forward, its gradient sums backward: each rank sends the same
  numbers to every rank in one step, each way per norm) and no others: what the ranks'
  waiting for each other costs where nothing but the norms makes them wait.

Where PhysicsNeMo's ``ShardTensor`` imports (``physicsnemo.domain_parallel``; it is not in
the bench extra, as it requires torchvision), it is run on the same model and strips: the
forward alone is timed side by side (``domain_fwd``, ``shardtensor_fwd``, ``ideal_fwd``,
under ``no_grad``), and a whole step is tried once (``shardtensor_step``: "ok" or the error
it raised). Its tile shapes are given explicitly: inferring them allocates pinned memory,
which needs an accelerator.

Also per rank: the halo bytes a step after the first sends (forward and backward,
`tensorpar.CommCounter`; for the U-Net, with the rows sent ahead in the norms' exchanges)
against the exact count for the conv stack (each interior boundary: one row of 32 channels
each way per conv forward, and per conv but the first backward, as the input needs no
gradient), and the bytes of activations autograd saves (``saved_tensors_hooks``, each storage
once) against the dense model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tensorpar
from tensorpar.bench.workloads._timing import equal_on_every_rank, time_side_by_side
from tensorpar.comm._comm import all_gather_into
from tensorpar.comm._group import resolve_group
from tensorpar.nn import domain_layout, parallelize_domain

__all__ = ["WORKLOADS", "run_rank"]

WORKLOADS = ("conv8", "unet")


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class _UNet(nn.Module):
    def __init__(self, w: int = 16) -> None:
        super().__init__()
        self.enc1, self.pool, self.enc2 = _block(1, w), nn.MaxPool2d(2), _block(w, 2 * w)
        self.down = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)
        self.mid = _block(2 * w, 4 * w)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), _block(4 * w, 2 * w)
        self.up1, self.dec1 = nn.Upsample(scale_factor=2, mode="bilinear"), _block(3 * w, w)
        self.out = nn.Conv2d(w, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.down(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        return self.out(self.dec1(torch.cat([self.up1(d2), e1], 1)))  # type: ignore[no-any-return]


def _model(name: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if name == "conv8":
        return nn.Sequential(*[nn.Conv2d(32, 32, 3, padding=1) for _ in range(8)]), 32
    return _UNet(), 1


class _NormExchange(torch.autograd.Function):
    """The identity, with a norm's exchanges: its statistics forward, its sums backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        _exchange(1 + 2 * k)  # a count, K means and K squared deviations
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        _exchange(2 * ctx.k)  # two sums per statistics channel
        return g, None


def _exchange(numel: int) -> None:
    """Every rank sends ``numel`` float64s to every rank in one step, as the norms do."""
    group = resolve_group(None)
    stats = torch.zeros(numel, dtype=torch.float64)
    all_gather_into(stats.new_empty(numel * group.size), stats, group, one_step=True)


def _with_norm_exchanges(model: nn.Module) -> nn.Module:
    """``model`` with the exchanges any exact domain-parallel norm needs, and no others.

    (For a batch of one: a batch norm's statistics channels are its channels, a group
    norm's its groups.)
    """
    def hook(m: nn.Module, _: Any, out: torch.Tensor) -> torch.Tensor:
        k = m.num_groups if isinstance(m, nn.GroupNorm) else out.shape[1]
        return _NormExchange.apply(out, k)  # type: ignore[no-untyped-call,no-any-return]

    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d)):
            m.register_forward_hook(hook)
    return model


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in one step, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return total[0]


def run_rank(name: str, size: int, rounds: int) -> dict[str, Any]:
    """One workload on this rank (every rank calls it); the figures of the slowest rank."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    dense, channels = _model(name)
    sizes = [size // world + (r < size % world) for r in range(world)]
    start = sum(sizes[:rank])
    full = torch.randn(1, channels, size, size)
    tile = full[:, :, start:start + sizes[rank]].contiguous()
    if name == "conv8":
        lo, hi = min(1, start), min(1, size - start - sizes[rank])
        ideal_in = full[:, :, start - lo:start + sizes[rank] + hi].contiguous()
    else:  # the U-Net needs a multiple of 4 rows: two more on each side
        ideal_in = torch.randn(1, channels, sizes[rank] + 4, size)
    model = parallelize_domain(copy.deepcopy(dense), dims=-2)
    ideal = copy.deepcopy(dense)

    def step(m: nn.Module, x: torch.Tensor) -> None:
        m(x).sum().backward()

    with torch.no_grad():  # the dense model's output tile, before anything is timed
        want, got = dense(full), model(tile)
    split = domain_layout(model)[0][want.shape[-2]]
    equal_on_every_rank(got, want.narrow(-2, sum(split[:rank]), split[rank]),
                        f"the domain-parallel {name}'s output")
    step(model, tile)  # (the first forward learns which halo rows go ahead with the norms)
    with tensorpar.CommCounter() as counter:
        step(model, tile)
    halo = counter.nbytes("all_to_all")
    if name == "conv8":
        interior = (rank > 0) + (rank < world - 1)
        # 8 convs forward, 7 backward (the input tile needs no gradient), float32 rows
        exact: int | None = (8 + 7) * interior * channels * size * 4
    else:
        exact = None
    saved = _saved_bytes(model, tile)
    saved_dense = _saved_bytes(ideal, full) if rank == 0 else 0
    cases: dict[str, Callable[[], object]] = {"domain": lambda: step(model, tile),
                                              "ideal": lambda: step(ideal, ideal_in)}
    pairs: tuple[tuple[str, str], ...] = (("domain", "ideal"),)
    if name == "unet":
        floor = _with_norm_exchanges(copy.deepcopy(dense))
        cases["floor"] = lambda: step(floor, ideal_in)
        pairs += (("floor", "ideal"), ("domain", "floor"))
    times = time_side_by_side(cases, rounds=rounds, pairs=pairs)
    times.update(_shardtensor(dense, model, ideal, tile, ideal_in, sizes, rounds))
    figures = torch.tensor([halo, exact or 0, saved], dtype=torch.float64)
    every = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(every, figures)
    return {"workload": name, "world_size": world, "size": size, **times,
            "halo_bytes": [int(f[0]) for f in every],
            "exact_bytes": None if exact is None else [int(f[1]) for f in every],
            "saved_bytes": [int(f[2]) for f in every], "saved_dense": saved_dense}


def _shardtensor(dense: nn.Module, model: nn.Module, ideal: nn.Module, tile: torch.Tensor,
                 ideal_in: torch.Tensor, sizes: list[int], rounds: int) -> dict[str, Any]:
    """PhysicsNeMo's ShardTensor on the same strips, where it imports (see the module doc)."""
    try:
        from physicsnemo.domain_parallel import ShardTensor
        from physicsnemo.domain_parallel.shard_utils import (  # noqa: F401 (registers handlers)
            conv_patches,
            normalization_patches,
            pooling_patches,
            unpooling_patches,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
    except Exception as exc:  # not installed, or its imports fail against this torch
        return {"shardtensor_step": f"not run: {type(exc).__name__}: {exc}"[:160]}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shape = tuple(tile.shape)
    shapes = {0: [(*shape[:2], n, *shape[3:]) for n in sizes]}
    theirs = copy.deepcopy(dense)

    def sharded() -> Any:
        return ShardTensor.from_local(tile, mesh, [Shard(2)], sharding_shapes=shapes)
    ready = sharded()  # (made once, as the other cases get their tile ready)

    def forward(m: nn.Module, x: Any) -> None:
        with torch.no_grad():
            m(x)

    out: dict[str, Any] = {}
    try:
        forward(theirs, sharded())
    except Exception as exc:
        return {"shardtensor_step": f"forward fails: {type(exc).__name__}: {exc}"[:160]}
    try:
        theirs(sharded()).sum().backward()
        out["shardtensor_step"] = "ok"
    except Exception as exc:
        out["shardtensor_step"] = f"backward fails: {type(exc).__name__}: {exc}"[:160]
    out.update(time_side_by_side(
        {"domain_fwd": lambda: forward(model, tile),
         "shardtensor_fwd": lambda: forward(theirs, ready),
         "ideal_fwd": lambda: forward(ideal, ideal_in)},
        rounds=rounds, pairs=(("domain_fwd", "ideal_fwd"), ("shardtensor_fwd", "ideal_fwd"),
                              ("shardtensor_fwd", "domain_fwd"))))
    return out
