"""Data-parallel gradient averaging: `BucketedAllReduce` next to DDP and baselines.

Every variant runs forward + backward (+ its gradient averaging) of its own copy of the same
float32 MLP, built from the same seed on every rank, on the same per-rank input; no optimizer
step. Variants:

- ``tensorpar``: ``BucketedAllReduce(model, bucket_cap_mb=25, broadcast_buffers=False)``;
- ``tensorpar_default``: the same with its default bucket size (a quarter of the gradients,
  in [1, 25] MiB);
- ``ddp``: ``DistributedDataParallel(model, bucket_cap_mb=25, broadcast_buffers=False,
  gradient_as_bucket_view=True)`` (gradients as views of the buckets, as tensorpar's);
- ``per_param``: after backward, one blocking all-reduce per gradient, then a division;
- ``flatten_at_end``: after backward, concatenate every gradient, one all-reduce, divide,
  copy back;
- ``no_comm``: forward + backward only (the compute floor);
- ``raw_all_reduce``: one in-place all-reduce of a flat float32 tensor as large as all the
  gradients together (no compute).

``zero_grad(set_to_none=True)`` runs for every model between rounds, outside the timed calls.
Peak memory (VmHWM) of ``tensorpar`` and ``ddp`` is measured separately, one model and
reducer per rank-function call.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.ddp.reducer import BucketedAllReduce

__all__ = ["MODELS", "VARIANTS", "build_model", "check_parity", "memory_rank", "run_rank"]

MODELS: dict[str, int] = {"8M": 1000, "30M": 1936}
"""Model name -> width of its 8 square Linear layers (with bias): 16 parameter tensors."""
LAYERS = 8
BATCH = 8
VARIANTS = ("tensorpar", "tensorpar_default", "ddp", "per_param", "flatten_at_end", "no_comm",
            "raw_all_reduce")
MEMORY_VARIANTS = ("tensorpar", "ddp")

Step = Callable[[], object]


def build_model(name: str) -> nn.Sequential:
    """The MLP called ``name`` in `MODELS`, initialised from a fixed seed (equal on all ranks)."""
    width = MODELS[name]
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(width, width))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _input(name: str) -> torch.Tensor:
    """This rank's batch (differs between ranks, so averaging is not a no-op)."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randn(BATCH, MODELS[name], generator=gen)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out.square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        assert p.grad is not None
        grads.append(p.grad)
    return grads


def _per_param_step(model: nn.Module, x: torch.Tensor, world: int) -> None:
    _loss(model, x).backward()
    for g in _grads(model):
        dist.all_reduce(g)
        g.div_(world)


def _flatten_step(model: nn.Module, x: torch.Tensor, world: int) -> None:
    _loss(model, x).backward()
    grads = _grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _ddp(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # newer torch deprecates broadcast_buffers; still honoured
        warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
        # (gradients as views of the buckets, as BucketedAllReduce keeps them by default)
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25,
                                                   broadcast_buffers=False,
                                                   gradient_as_bucket_view=True)


def _tensorpar(model: nn.Module, bucket_cap_mb: float | None = 25) -> BucketedAllReduce:
    return BucketedAllReduce(model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False)


def _make_steps(name: str
                ) -> tuple[dict[str, nn.Module], dict[str, Step], list[BucketedAllReduce]]:
    """Each variant's model (its own copy, same seed), its one-iteration step, the reducers.

    Call ``remove()`` on the reducers when done: its gradient hooks close a reference cycle
    through the parameters that the garbage collector cannot see, so it would never be freed.
    """
    world = dist.get_world_size()
    x = _input(name)
    models: dict[str, nn.Module] = {v: build_model(name) for v in VARIANTS
                                    if v != "raw_all_reduce"}
    tp_reducer = _tensorpar(models["tensorpar"])
    default_reducer = _tensorpar(models["tensorpar_default"], None)
    ddp = _ddp(models["ddp"])
    numel = sum(p.numel() for p in models["no_comm"].parameters())
    flat = torch.zeros(numel)  # zeros stay zeros however often they are summed
    steps: dict[str, Step] = {
        "tensorpar": lambda: _loss(tp_reducer.module, x).backward(),
        "tensorpar_default": lambda: _loss(default_reducer.module, x).backward(),
        "ddp": lambda: _loss(ddp, x).backward(),
        "per_param": lambda: _per_param_step(models["per_param"], x, world),
        "flatten_at_end": lambda: _flatten_step(models["flatten_at_end"], x, world),
        "no_comm": lambda: _loss(models["no_comm"], x).backward(),
        "raw_all_reduce": lambda: dist.all_reduce(flat),
    }
    return models, steps, [tp_reducer, default_reducer]


def check_parity(models: dict[str, nn.Module], steps: dict[str, Step],
                 variants: Sequence[str] = ("tensorpar", "tensorpar_default", "ddp", "per_param",
                                            "flatten_at_end"),
                 rtol: float = 1e-5) -> None:
    """One iteration of each averaging variant (DDP among them); raise unless equal to DDP's.

    The gradients are averaged, so a difference shows on every rank alike.
    """
    for v in variants:
        models[v].zero_grad(set_to_none=True)
        steps[v]()
    reference = _grads(models["ddp"])
    for v in variants:
        for i, (ours, theirs) in enumerate(zip(_grads(models[v]), reference, strict=True)):
            if not torch.allclose(ours, theirs, rtol=rtol, atol=rtol * 1e-3):
                raise RuntimeError(f"reducer benchmark: {v}'s gradient {i} differs from "
                                   f"DDP's (max abs diff "
                                   f"{(ours - theirs).abs().max().item():.3g}); not timed")


def run_rank(name: str, rounds: int) -> dict[str, Any]:
    """One rank's part of the timing phase for model ``name``; the same dict on every rank.

    Keys: ``model``, ``world_size``, ``params``, ``tensors``, ``grad_bytes``, each variant's
    median seconds per iteration, ``zero_grad`` (seconds to zero all five models, untimed
    for the variants), ``tp_over_ddp`` and ``tp_default_over_ddp`` (paired ratios),
    ``exposed_<variant>`` (variant - no_comm) and ``exposed_<variant>_over_raw`` (exposed /
    raw_all_reduce).
    """
    from tensorpar.bench.workloads._timing import time_side_by_side

    models, steps, reducers = _make_steps(name)
    check_parity(models, steps)

    def zero_all() -> None:
        for m in models.values():
            m.zero_grad(set_to_none=True)

    # "zero_grad" runs first in every round, between barriers, so no variant's timed call
    # includes freeing or zeroing its gradients.
    t = time_side_by_side({"zero_grad": zero_all, **steps}, rounds=rounds,
                          pairs=(("tensorpar", "ddp"), ("tensorpar_default", "ddp")))
    for reducer in reducers:
        reducer.remove()
    params = list(models["no_comm"].parameters())
    row: dict[str, Any] = {
        "model": name, "world_size": dist.get_world_size(),
        "params": sum(p.numel() for p in params), "tensors": len(params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params), **t,
        "tp_over_ddp": t["tensorpar/ddp"],  # (paired: the median of each round's ratio)
        "tp_default_over_ddp": t["tensorpar_default/ddp"],
    }
    for v in ("tensorpar", "ddp", "per_param", "flatten_at_end"):
        row[f"exposed_{v}"] = t[v] - t["no_comm"]
        row[f"exposed_{v}_over_raw"] = row[f"exposed_{v}"] / t["raw_all_reduce"]
    return row


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc), for a clean start."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_rank(name: str, variant: str, iterations: int) -> dict[str, Any]:
    """Peak RSS of one rank training model ``name`` under ``variant`` (tensorpar or ddp).

    Only this call's model and reducer exist. The peak is reset after garbage collection,
    before the model is built; ``peak_kib`` covers building it plus ``iterations``
    iterations, ``steady_kib`` the peak of ``iterations`` more after releasing freed heap
    pages and resetting again.
    Where the peak cannot be reset (``hwm=False``), both are VmRSS after the iterations.
    """
    _release_freed_memory()
    base = _status_kib("VmRSS")
    hwm = _reset_peak()
    model = build_model(name)
    x = _input(name)
    wrapped: nn.Module
    reducer: BucketedAllReduce | None = None
    if variant == "tensorpar":
        reducer = _tensorpar(model)
        wrapped = model
    elif variant == "ddp":
        wrapped = _ddp(model)
    else:
        raise ValueError(f"memory_rank: unknown variant {variant!r}")

    def iterate() -> int:
        for _ in range(iterations):
            model.zero_grad(set_to_none=True)
            _loss(wrapped, x).backward()
        return _status_kib("VmHWM" if hwm else "VmRSS")

    peak = iterate()
    _release_freed_memory()
    steady_base = _status_kib("VmRSS")
    if hwm:
        _reset_peak()
    steady = iterate()
    if reducer is not None:
        reducer.remove()  # break its hook cycle, so the next call starts clean
    return {"model": name, "variant": variant, "world_size": dist.get_world_size(),
            "hwm": hwm, "base_kib": base, "peak_kib": peak, "steady_base_kib": steady_base,
            "steady_kib": steady}
