"""CollaborativeTensor: async results that must be resolved before use."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import CollaborativeTensor, UnresolvedCollectiveError
from tensorpar.testing import run_distributed


def _resolve_is_idempotent():
    rank, p = dist.get_rank(), dist.get_world_size()
    handle = tp.all_reduce(torch.full((1000,), float(rank)), async_op=True)
    assert isinstance(handle, CollaborativeTensor)
    assert handle.is_resolved() == (p == 1)  # one rank: nothing in flight
    assert handle.shape == (1000,) and handle.dtype == torch.float32
    first = handle.resolve()
    assert handle.is_resolved() and handle.resolve() is first
    assert torch.equal(first, torch.full((1000,), float(sum(range(p)))))
    return repr(handle)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_resolve(world_size):
    assert run_distributed(_resolve_is_idempotent, world_size)[0] == \
        "CollaborativeTensor(float32[1000], resolved)"


def _many_handles_one_sync():
    rank, p = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((64, 5), float(rank + i)) for i in range(6)]
    handles = [tp.all_reduce(x, async_op=True) for x in inputs]
    handles.append(tp.all_gather(torch.full((2, 3), float(rank)), async_op=True,
                                 sizes=[2] * p))
    handles.append(tp.reduce_scatter(torch.ones(p * 2, 3) * rank, async_op=True))
    handles.append(tp.broadcast(torch.arange(4.0) if rank == 0 else None, async_op=True))
    early = [h.assume_resolved() for h in handles]  # views handed out before any wait
    assert not any(h.is_resolved() for h in handles)
    resolved = tp.sync_collectives(handles)
    assert all(h.is_resolved() for h in handles)
    assert all(a is b for a, b in zip(early, resolved, strict=True))
    total = sum(range(p))
    for i in range(6):
        assert torch.equal(resolved[i], torch.full((64, 5), float(total + p * i)))
    assert torch.equal(resolved[6], torch.arange(p).repeat_interleave(2).float()[:, None]
                       .expand(2 * p, 3))
    assert torch.equal(resolved[7], torch.full((2, 3), float(total)))
    assert torch.equal(resolved[8], torch.arange(4.0))
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_assume_resolved_and_one_sync_for_many_handles(world_size):
    assert all(run_distributed(_many_handles_one_sync, world_size))


USES = {
    "operator +": lambda h: h + 1,
    "torch.add": lambda h: torch.add(h, 1),
    "Tensor.sum": lambda h: h.sum(),
    "indexing": lambda h: h[0],
    "bool()": lambda h: bool(h),
    "torch.cat": lambda h: torch.cat([h, h]),
}


def _use_before_resolve(use):
    handle = tp.all_reduce(torch.ones(3), async_op=True)
    try:
        USES[use](handle)
        raised = None
    except UnresolvedCollectiveError as e:
        raised = str(e)
    handle.resolve()
    return raised


@pytest.mark.parametrize("use", list(USES))
def test_use_before_resolve_raises(use):
    for message in run_distributed(_use_before_resolve, 2, use):
        assert message is not None and "handle, not a tensor" in message
        assert ".resolve()" in message


def test_use_after_resolve_points_to_the_tensor():
    handle = tp.all_reduce(torch.ones(3), async_op=True)  # one rank: resolved at once
    with pytest.raises(UnresolvedCollectiveError, match="returned"):
        handle * 2
    assert torch.equal(handle.resolve() * 2, torch.full((3,), 2.0))


def _inplace_reuses_storage():
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.full((1 << 16,), float(rank + 1))
    ptr = x.data_ptr()
    handle = tp.all_reduce(x, inplace=True, async_op=True)
    out = handle.resolve()
    same = out is x and out.data_ptr() == ptr
    y = torch.full((10,), 2.0)
    z = tp.all_reduce(y, op="mean", inplace=True)
    expected = float(sum(range(1, p + 1)))
    return (same, z is y, torch.equal(x, torch.full_like(x, expected)),
            torch.equal(y, torch.full_like(y, 2.0)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_inplace_reduces_into_input_storage(world_size):
    results = run_distributed(_inplace_reuses_storage, world_size)
    assert results == [(True, True, True, True)] * world_size


def _out_of_place_allocates():
    x = torch.ones(8)
    out = tp.all_reduce(x)
    return out.data_ptr() != x.data_ptr() and torch.equal(x, torch.ones(8))


def test_default_is_out_of_place():
    assert all(run_distributed(_out_of_place_allocates, 2))


def _drop_unresolved():
    rank, p = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        tp.all_reduce(torch.ones(1 << 18), async_op=True)  # dropped, never resolved
    del _
    after = tp.all_reduce(torch.full((4,), float(rank)))  # a later collective still works
    return torch.equal(after, torch.full((4,), float(sum(range(p)))))


def test_dropping_an_unresolved_handle_does_not_deadlock():
    assert all(run_distributed(_drop_unresolved, 3, timeout=30))


def _async_with_autograd():
    rank = dist.get_rank()
    x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = tp.all_reduce(x, async_op=True).resolve()
    (y * (rank + 1)).sum().backward()
    return x.grad.tolist()


def test_async_result_is_differentiable():
    assert run_distributed(_async_with_autograd, 2) == [[3.0] * 3] * 2


def test_sync_collectives_rejects_tensors():
    with pytest.raises(TypeError, match=r"handles\[1\] is a Tensor"):
        tp.sync_collectives([tp.all_reduce(torch.ones(1), async_op=True), torch.ones(1)])


def _all_gather_reassembled_on_resolve(requires_grad):
    """Uneven chunks along dim 1 (a batch dim before it): still in flight until resolved."""
    rank, p = dist.get_rank(), dist.get_world_size()
    sizes = [len(c) for c in torch.arange(7).tensor_split(p)]  # 4, 3 / 3, 2, 2
    whole = torch.arange(2 * 7 * 3, dtype=torch.float64).view(2, 7, 3)
    mine = whole.tensor_split(p, dim=1)[rank].clone().requires_grad_(requires_grad)
    handle = tp.all_gather(mine, dim=1, sizes=sizes, async_op=True)
    in_flight = not handle.is_resolved()
    got = handle.resolve()
    assert torch.equal(got, whole), got
    if requires_grad:  # the reassembly must not count as an in-place change for autograd
        (got * torch.arange(1.0, 8.0, dtype=torch.float64)[:, None]).sum().backward()
        expected = p * torch.arange(1.0, 8.0, dtype=torch.float64)[:, None].expand(7, 3)
        assert torch.equal(mine.grad, expected.tensor_split(p)[rank].expand_as(mine)), mine.grad
    return in_flight


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_all_gather_is_reassembled_when_resolved(world_size, requires_grad):
    assert all(run_distributed(_all_gather_reassembled_on_resolve, world_size, requires_grad,
                               timeout=30))
