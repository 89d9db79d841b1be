"""Partial-gradient parameters under FSDP2: DP 2 x TP 2 trains like the dense model.

Sequence parallelism's norms and Qwen3's per-head ``q_norm``/``k_norm`` sum their gradients
over the tensor-parallel group with a hook on the parameter; ``fully_shard`` computes with
unsharded twins of the parameters, which must carry that hook too (the norms that recompute
in backward replay with them as well).
"""

import pytest

import tensorpar as tp
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _dense_step, _loss, _mesh
from tests.test_clip import build as build_llama
from tests.test_fsdp_tp import TOL, _optimizer, batch, both

pytest.importorskip("transformers")

STEPS = 3


def _build(arch):
    if arch == "llama":
        return build_llama()
    from tests.test_sequence_parallel import build

    return build(arch)


def _fsdp_trains_like_dense(arch, mode):
    import torch
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    plan = plan_from_transformers(_build(arch), sequence_parallel=mode)
    model = tp.parallelize(_build(arch), plan, group=mesh["tp"])
    head = model.get_output_embeddings()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer(model.parameters())
    dense = _build(arch)
    opt_d = _optimizer(dense.parameters())
    for step in range(STEPS):
        _loss(model, batch(step, mesh.get_local_rank("dp")), head).backward()
        opt.step(), opt.zero_grad()
        _dense_step(dense, both(step))
        opt_d.step(), opt_d.zero_grad()
    full = tp.full_state_dict(model, group=mesh["tp"])
    if mesh.get_local_rank("tp") != 0:  # the whole tensors are gathered on TP rank 0
        return True
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=TOL, atol=TOL, msg=key)
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("arch", "mode"), [("llama", True), ("llama", "regather"),
                                            ("qwen3", False), ("qwen3", True)])
def test_partial_gradients_under_fsdp2_train_like_dense(arch, mode):
    assert all(run_distributed(_fsdp_trains_like_dense, 4, arch, mode, timeout=240))
