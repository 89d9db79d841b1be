"""Shared check for domain-parallel tests: the converted model against the dense one.

Every rank builds the same dense model and input (float64, fixed seeds), runs the dense
reference itself, converts a copy with `parallelize_domain`, runs it on its tile and
compares: its output tile, every parameter gradient, its input tile's gradient and every
buffer (BatchNorm running statistics). Returns the largest difference seen.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.nn import domain_layout, parallelize_domain

Builder = Callable[[], nn.Module]


def _coords(mesh_shape: Sequence[int] | None) -> tuple[int, ...]:
    rank = dist.get_rank()
    if mesh_shape is None:
        return (rank,)
    out = []
    for size in reversed(mesh_shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def tile_of(t: torch.Tensor, dims: Sequence[int], splits: Sequence[Sequence[int]],
            coords: Sequence[int]) -> torch.Tensor:
    for d, sizes, c in zip(dims, splits, coords, strict=False):
        t = t.narrow(d, sum(sizes[:c]), sizes[c])
    return t


def check(build: Builder, shape: Sequence[int], dims: Sequence[int],
          splits: Sequence[Sequence[int]], mesh_shape: Sequence[int] | None = None,
          steps: int = 0, extra: Callable[[], tuple] | None = None, train: bool = True,
          replicated: bool = False, compile_backend: str | None = None, lr: float = 0.1,
          relative: bool = False) -> float:
    """Largest |parallel - dense| over outputs, gradients, buffers (and SGD steps).

    ``compile_backend``: run the converted model through ``torch.compile`` with it.
    ``lr``: the SGD (momentum 0.9) learning rate of the steps; a model whose outputs grow
    tenfold a step at the default amplifies rounding as fast (any two correct
    implementations drift apart).
    ``relative``: each difference divided by the dense tensor's largest magnitude where
    that is above 1 (for a model whose gradients reach 50: float64 rounding alone is 1e-9
    there).
    """
    torch.manual_seed(0)
    model = build().double()
    model.train(train)
    x = torch.randn(*shape, dtype=torch.float64)
    more = extra() if extra is not None else ()
    dense = copy.deepcopy(model)
    group = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", tuple(mesh_shape))
    par = parallelize_domain(copy.deepcopy(model), dims=tuple(dims), group=group)
    coords = _coords(mesh_shape)
    run = par if compile_backend is None else torch.compile(par, backend=compile_backend)
    worst = 0.0
    opt_d = torch.optim.SGD(dense.parameters(), lr=lr, momentum=0.9)
    opt_p = torch.optim.SGD(par.parameters(), lr=lr, momentum=0.9)

    def diff(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if not a.numel():
            return 0.0
        worst = float((a - b).detach().abs().max())
        return worst / max(float(b.detach().abs().max()), 1.0) if relative else worst

    for step in range(max(steps, 1)):
        xd = x.clone().requires_grad_(True)
        out_d = dense(xd, *more)
        out_d = out_d.sample if hasattr(out_d, "sample") else out_d
        torch.manual_seed(1000 + step)
        gout = torch.randn_like(out_d)
        (out_d * gout).sum().backward()
        xt = tile_of(x, dims, splits, coords).clone().requires_grad_(True)
        out = run(xt, *more)
        out = out.sample if hasattr(out, "sample") else out
        layout = domain_layout(par)
        if replicated:
            want, gt = out_d, gout  # replicated (after a global pooling)
        else:
            osplits = [layout[i][out_d.shape[d]] for i, d in enumerate(dims)]
            want, gt = tile_of(out_d, dims, osplits, coords), tile_of(gout, dims, osplits, coords)
        worst = max(worst, diff(out, want.detach(), "output"))
        (out * gt).sum().backward()
        worst = max(worst, diff(xt.grad, tile_of(xd.grad, dims, splits, coords), "input grad"))
        pd = dict(dense.named_parameters())
        for name, p in par.named_parameters():
            if pd[name].grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            assert p.grad is not None, f"{name}: no gradient"
            worst = max(worst, diff(p.grad, pd[name].grad, f"grad of {name}"))
        bd = dict(dense.named_buffers())
        for name, b in par.named_buffers():
            worst = max(worst, diff(b.double(), bd[name].double(), f"buffer {name}"))
        if steps:
            opt_d.step()
            opt_p.step()
            opt_d.zero_grad()
            opt_p.zero_grad()
            for name, p in par.named_parameters():
                worst = max(worst, diff(p.detach(), pd[name].detach(), f"{name} after step"))
    return worst


def check_or_error(build: Builder, hs: Sequence[int], ws: Sequence[int],
                   mesh_shape: Sequence[int] | None) -> float | str:
    """`check` of a batch of 2 two-channel images of ``sum(hs) x sum(ws)``, or its error.

    Split along H into ``hs`` (strips) where ``mesh_shape`` is ``None``, else into ``hs x
    ws`` tiles on a mesh of that shape. Returns the ``ValueError``'s message where the
    converted model raises one.
    """
    shape = (2, 2, sum(hs), sum(ws))
    try:
        if mesh_shape is None:
            return check(build, shape, (-2,), (hs,))
        return check(build, shape, (-2, -1), (hs, ws), mesh_shape=mesh_shape)
    except ValueError as e:
        return str(e)
