"""The same code on CUDA tensors: every collective, the async handles, the layers and the
reducer, checked against the CPU results.

With one GPU, several ranks share it over gloo (NCCL refuses two ranks on one device), and
NCCL runs as a group of one. These tests need a CUDA device and are skipped without one.
"""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.testing import run_distributed
from tests._reference import CASES
from tests.test_collectives import _check_case
from tests.test_layers import _column, _row
from tests.test_reducer import PARITY, _parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_collectives_on_cuda_tensors_over_gloo(name, world_size):
    assert run_distributed(_check_case, world_size, name, None, "cuda") == ["ok"] * world_size


@pytest.mark.parametrize("name", sorted(CASES))
def test_collectives_on_a_single_rank_nccl_group(name):
    assert run_distributed(_check_case, 1, name, None, "cuda", backend="nccl") == ["ok"]


def _async_on_cuda():
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.full((1 << 16,), float(rank + 1), device="cuda")
    ptr = x.data_ptr()
    handles = [tp.all_reduce(x, inplace=True, async_op=True),
               tp.all_gather(torch.full((2, 3), float(rank), device="cuda"), async_op=True,
                             sizes=[2] * p),
               tp.reduce_scatter(torch.ones(p * 2, 3, device="cuda") * rank, async_op=True),
               tp.broadcast(torch.arange(4.0, device="cuda") if rank == 0 else None,
                            async_op=True)]
    reduced, gathered, scattered, broadcast = tp.sync_collectives(handles)
    total = float(sum(range(p)))
    return (reduced is x and reduced.data_ptr() == ptr,
            torch.equal(reduced.cpu(), torch.full((1 << 16,), total + p)),
            torch.equal(gathered.cpu(), torch.arange(p).repeat_interleave(2).float()[:, None]
                        .expand(2 * p, 3)),
            torch.equal(scattered.cpu(), torch.full((2, 3), total)),
            torch.equal(broadcast.cpu(), torch.arange(4.0)),
            {t.device.type for t in (reduced, gathered, scattered, broadcast)} == {"cuda"})


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_handles_on_cuda(world_size):
    assert run_distributed(_async_on_cuda, world_size) == [(True,) * 6] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_parallel_linear_layers_on_cuda(world_size, dtype):
    for gather_output in (False, True):
        sizes = run_distributed(_column, world_size, gather_output, dtype, "cuda")[0]
        assert sum(sizes) == 37
    for input_is_parallel in (False, True):
        assert all(run_distributed(_row, world_size, input_is_parallel, dtype, "cuda"))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name, options, micro, dtype, tol", PARITY[:4],
                         ids=[f"{m}-{'x'.join(map(str, o.values())) or 'default'}"
                              for m, o, k, d, t in PARITY[:4]])
def test_reducer_matches_ddp_on_cuda(world_size, name, options, micro, dtype, tol):
    results = run_distributed(_parity, world_size, name, options, 4, micro, dtype, "cuda",
                              timeout=120)
    for gap, moved, _ in results:
        assert gap <= tol and moved > 0, results


def _sequence_parallel_on_cuda(mode):
    """A transformers Llama with sequence parallelism on CUDA tensors equals the dense one."""
    import torch.nn.functional as F

    from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy
    from tests.test_clip import dense_slice as local
    from tests.test_sequence_parallel import build, tokens

    dense = build("llama").cuda()
    parallel = tp.parallelize(build("llama").cuda(), plan_from_transformers(
        build("llama"), sequence_parallel=mode))
    head = parallel.get_output_embeddings()
    for n in (1, 7, 64):
        ids = tokens(n, n).cuda()
        target = ids.roll(-1, 1)
        dense_loss = F.cross_entropy(dense(ids).logits.flatten(0, 1), target.flatten())
        loss = vocab_parallel_cross_entropy(parallel(ids).logits.flatten(0, 1), target.flatten(),
                                            sizes=head.shard.sizes)
        torch.testing.assert_close(loss, dense_loss, rtol=1e-10, atol=1e-10)
        dense_loss.backward(), loss.backward()
        grads = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            assert p.grad.is_cuda
            torch.testing.assert_close(p.grad, local(parallel, name, grads[name].grad),
                                       rtol=1e-10, atol=1e-10, msg=f"{name}, length {n}")
        dense.zero_grad(), parallel.zero_grad()
    return True


@pytest.mark.parametrize("mode", [True, "regather"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sequence_parallelism_on_cuda(world_size, mode):
    pytest.importorskip("transformers")
    assert all(run_distributed(_sequence_parallel_on_cuda, world_size, mode, timeout=120))


def test_sequence_parallelism_on_a_single_rank_nccl_group():
    pytest.importorskip("transformers")
    assert run_distributed(_sequence_parallel_on_cuda, 1, True, backend="nccl",
                           timeout=120) == [True]
