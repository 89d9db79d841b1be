"""Every dtype of the wire format through the data-moving collectives; reductions refuse
the dtypes the backend cannot reduce, on every rank, before communicating."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.placeholder import _CODE_TO_DTYPE
from tensorpar.testing import run_distributed

DTYPES = list(_CODE_TO_DTYPE.values())
GLOO_CANNOT_REDUCE = [torch.int16, torch.uint16, torch.uint32, torch.uint64,
                      torch.float8_e4m3fn, torch.float8_e5m2]


def _data(dtype, shape, seed):
    """Exact bit patterns of ``dtype`` (bools 0/1), the same on every rank for one seed."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _checks(rank, p, every, full):
    """Each data collective as (call, what this rank must receive)."""
    return {
        "broadcast": (lambda: tp.broadcast(full if rank == 1 else None, src=1), full),
        "scatter": (lambda: tp.scatter(full if rank == 0 else None, src=0,
                                       sizes=[2 * r + 1 for r in range(p)]), every[rank]),
        "gather": (lambda: tp.gather(every[rank], dst=1), full),
        "all_gather": (lambda: tp.all_gather(every[rank]), full),
        "all_gather dim0 sizes": (
            lambda: tp.all_gather(every[0], sizes=[1] * p), torch.cat([every[0]] * p)),
        "all_to_all": (lambda: tp.all_to_all(full, split_dim=0, concat_dim=0,
                                             sizes=[2 * r + 1 for r in range(p)]),
                       torch.cat([every[rank]] * p)),
        "all_to_all shapes": (
            lambda: tp.all_to_all(every[rank], split_dim=1, concat_dim=0),
            torch.cat([e.tensor_split(p, dim=1)[rank] for e in every])),
    }


def _move_every_dtype():
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in DTYPES:
        name = str(dtype)
        every = [_data(dtype, (2 * r + 1, 3), seed=r) for r in range(p)]  # uneven lengths
        full = torch.cat(every)
        checks = _checks(rank, p, every, full)
        for what, (call, expected) in checks.items():
            try:
                got = call()
            except Exception as exc:
                failures.append(f"{what} {name}: {type(exc).__name__}: {exc}")
                continue
            if what == "gather" and rank != 1:
                if not (tp.is_placeholder(got) and got.shape == full.shape):
                    failures.append(f"{what} {name}: no placeholder")
            elif not _same_bits(got, expected):
                failures.append(f"{what} {name}: wrong result")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_dtype_moves_through_the_data_collectives(world_size):
    assert run_distributed(_move_every_dtype, world_size, timeout=60) == [[]] * world_size


def _reductions(x):
    return {
        "all_reduce": lambda: tp.all_reduce(x),
        "reduce_scatter": lambda: tp.reduce_scatter(x),
        "reduce": lambda: tp.reduce(x, dst=0),
        "all_reduce max": lambda: tp.all_reduce(x, op="max"),
    }


def _reduce_every_dtype():
    results = {}
    for dtype in DTYPES:
        for name, call in _reductions(torch.ones(4).to(dtype)).items():
            try:
                call()
                results[f"{name} {dtype}"] = "ok"
            except TypeError as exc:
                results[f"{name} {dtype}"] = str(exc)
    dist.barrier()  # every rank is still paired with the others
    return results


def test_reductions_refuse_what_gloo_cannot_reduce_on_every_rank():
    first, second = run_distributed(_reduce_every_dtype, 2, timeout=60)
    assert first == second
    for dtype in DTYPES:
        for name in ("all_reduce", "reduce_scatter", "reduce"):
            got = first[f"{name} {dtype}"]
            if dtype in GLOO_CANNOT_REDUCE:
                short = str(dtype).removeprefix("torch.")
                assert got.startswith(f"{name}: the gloo backend cannot reduce {short} "), got
            else:
                assert got == "ok", (name, dtype, got)
        maximum = first[f"all_reduce max {dtype}"]
        if dtype.is_complex:
            assert "complex numbers cannot be" in maximum
        elif dtype not in GLOO_CANNOT_REDUCE:
            assert maximum == "ok", (dtype, maximum)


def test_the_refusal_is_a_tensorpar_type_error():
    assert issubclass(tp.CollectiveTypeError, TypeError)
    assert issubclass(tp.CollectiveTypeError, tp.TensorparError)


def test_a_reduce_dtype_layer_runs_on_the_meta_device():
    """The widened product entered ``torch.autocast("meta", enabled=False)`` even with
    autocast off, which torch refuses on the meta device (a model built on meta)."""
    from tensorpar.nn import RowParallelLinear

    layer = RowParallelLinear.from_dense(torch.nn.Linear(4, 2), reduce_dtype=torch.float64,
                                         input_is_parallel=False).to("meta")
    out = layer(torch.empty(3, 4, device="meta"))
    assert out.shape == (3, 2) and out.dtype == torch.float32 and out.is_meta
