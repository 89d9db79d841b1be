"""Sequence parallelism under FSDP2: DP 2 x TP 2 trains like the dense model (the norms that
recompute in backward replay with FSDP2's unsharded parameters)."""

import pytest

import tensorpar as tp
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _loss, _mesh, build
from tests.test_fsdp_tp import TOL, _dense, _optimizer, batch

pytest.importorskip("transformers")

STEPS = 3


def _fsdp_sequence(mode):
    import torch
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    plan = plan_from_transformers(build(), sequence_parallel=mode)
    model = tp.parallelize(build(), plan, group=mesh["tp"])
    head = model.get_output_embeddings()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer(model.parameters())
    for step in range(STEPS):
        _loss(model, batch(step, mesh.get_local_rank("dp")), head).backward()
        opt.step(), opt.zero_grad()
    full = tp.full_state_dict(model, group=mesh["tp"])
    if mesh.get_local_rank("tp") != 0:  # the whole tensors are gathered on TP rank 0
        return True
    dense = dict(_dense(STEPS).state_dict())
    for key, value in full.items():
        torch.testing.assert_close(value, dense[key], rtol=TOL, atol=TOL, msg=key)
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [True, "regather"])
def test_sequence_parallel_under_fsdp2_trains_like_dense(mode):
    assert all(run_distributed(_fsdp_sequence, 4, mode, timeout=240))
