"""Property tests: random shapes, dims, dtypes, uneven sizes with zeros, roots and world
sizes 1-4, for the round trips and gradients of the collectives; random headers."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorpar as tp
from tensorpar.errors import WireFormatError
from tensorpar.placeholder import (
    _CODE_TO_DTYPE,
    HEADER_LEN,
    KIND_PLACEHOLDER,
    KIND_TENSOR,
    MAGIC,
    MAX_NDIM,
    decode_header,
    encode_header,
)
from tensorpar.testing import run_distributed

BOUNDED = settings(max_examples=12, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float64, torch.float32, torch.int16, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.uint32]


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _full(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape) * 31 + len(shape))
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).view(shape)


def _round_trips(shape, dim, dtype_name, sizes, root):
    rank, p = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    full = _full(shape, dtype)
    parts = full.split(sizes, dim)
    bad = []

    def same(name, got, want):
        if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            bad.append(name)

    chunk = tp.scatter(full if rank == root else None, dim=dim, src=root, sizes=sizes)
    same("scatter", chunk, parts[rank])
    gathered = tp.gather(chunk, dim=dim, dst=root)
    if rank == root:
        same("gather", gathered, full)
    elif not (tp.is_placeholder(gathered) and gathered.shape == full.shape):
        bad.append("gather placeholder")
    same("all_gather", tp.all_gather(chunk, dim=dim), full)
    same("all_gather sizes", tp.all_gather(chunk, dim=dim, sizes=sizes), full)
    same("broadcast", tp.broadcast(full if rank == root else None, src=root), full)
    same("all_to_all", tp.all_to_all(full, split_dim=dim, concat_dim=dim, sizes=sizes),
         torch.cat([parts[rank]] * p, dim))
    if dtype == torch.float64:  # gradients against the single-process reference
        weight = [torch.arange(part.numel(), dtype=dtype).view(part.shape) + r
                  for r, part in enumerate(parts)]
        x = full.clone().requires_grad_(rank == root)
        out = tp.scatter(x if rank == root else None, dim=dim, src=root, sizes=sizes)
        (out * weight[rank]).sum().backward()
        if rank == root:
            same("scatter grad", x.grad, torch.cat(weight, dim))
        y = parts[rank].clone().requires_grad_()
        z = tp.all_gather(y, dim=dim)
        (z * torch.cat(weight, dim) * (rank + 1)).sum().backward()
        same("all_gather grad", y.grad, weight[rank] * p * (p + 1) / 2)
        r = tp.reduce_scatter(full.clone().requires_grad_(), dim=dim, sizes=sizes)
        same("reduce_scatter", r.detach(), parts[rank] * p)
    return bad


@st.composite
def _cases(draw):
    p = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    sizes = draw(st.lists(st.integers(0, 3), min_size=p, max_size=p))
    shape[dim] = sum(sizes)
    dtype = draw(st.sampled_from(DTYPES))
    root = draw(st.integers(0, p - 1))
    return p, tuple(shape), dim, str(dtype).removeprefix("torch."), sizes, root


@BOUNDED
@given(_cases())
def test_round_trips_and_gradients_match_the_single_process_reference(case):
    p, shape, dim, dtype, sizes, root = case
    if p == 1 and sum(sizes) == 0:
        return
    results = run_distributed(_round_trips, p, shape, dim, dtype, sizes, root, timeout=60)
    assert results == [[]] * p, (case, results)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=HEADER_LEN, max_size=HEADER_LEN))
def test_random_headers_are_rejected_cleanly(values):
    with contextlib.suppress(WireFormatError):  # anything else fails the test
        decode_header(torch.tensor(values, dtype=torch.int64))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from([KIND_TENSOR, KIND_PLACEHOLDER]),
       st.lists(st.integers(0, 5), max_size=MAX_NDIM), st.sampled_from(list(_CODE_TO_DTYPE)),
       st.integers(0, HEADER_LEN - 1), st.integers(-(2**63), 2**63 - 1))
def test_a_corrupted_slot_decodes_or_raises_a_wire_format_error(kind, shape, code, slot,
                                                                  value):
    header = encode_header(kind, shape, _CODE_TO_DTYPE[code], root=1)
    header[slot] = value
    try:
        decoded = decode_header(header)
    except WireFormatError:
        return
    assert header[0] == MAGIC and decoded.kind in (KIND_TENSOR, KIND_PLACEHOLDER, 2, 3)


@pytest.mark.parametrize("bad", [None, [1, 2, 3], "header"])
def test_a_header_that_is_not_a_tensor_is_a_wire_format_error(bad):
    with pytest.raises(WireFormatError):
        decode_header(bad)
