"""FSDP2 (fully_shard) beside tensor parallelism: checkpoints save at DP 2 x TP 2 and load
into the dense model and at DP 1 x TP 4."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tensorpar as tp
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _dense_step, _loss, _mesh, build, dense_slice, tokens

pytest.importorskip("transformers")

TOL = 1e-10
SAVED_AT, TOTAL = 2, 5


def batch(step, dp_rank):
    return tokens(100 * step + dp_rank)


def both(step):
    """What the dense model (and a run without data parallelism) sees at ``step``."""
    return torch.cat([batch(step, r) for r in range(2)])


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _dense(steps):
    dense = build()
    opt = _optimizer(dense.parameters())
    for step in range(steps):
        _dense_step(dense, both(step))
        opt.step(), opt.zero_grad()
    return dense


def _fsdp_tp_save(path):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = tp.parallelize(build(), plan_from_transformers(build()), group=mesh["tp"])
    head = model.get_output_embeddings()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer(model.parameters())
    for step in range(SAVED_AT):
        _loss(model, batch(step, mesh.get_local_rank("dp")), head).backward()
        opt.step(), opt.zero_grad()
    dcp.save({"model": tp.sharded_state_dict(model),
              "optim": tp.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    full = tp.full_state_dict(model, group=mesh["tp"])
    try:
        model.state_dict()
        refusal = None
    except ValueError as e:
        refusal = str(e)
    if mesh.get_local_rank("tp") == 0:
        dense = dict(_dense(SAVED_AT).state_dict())
        for key, value in full.items():
            torch.testing.assert_close(value, dense[key], rtol=TOL, atol=TOL, msg=key)
    return refusal


def load_perturbed(model, opt, path):
    """Shift ``model``'s weights (nothing of them may survive), then load model and
    optimizer state from the DCP checkpoint at ``path``."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = {"model": tp.sharded_state_dict(model),
             "optim": tp.sharded_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state["model"])
    tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])


def _resume(path, parallel):
    model = tp.parallelize(build(), plan_from_transformers(build())) if parallel else build()
    opt = _optimizer(model.parameters())
    load_perturbed(model, opt, path)
    head = model.get_output_embeddings()
    for step in range(SAVED_AT, TOTAL):
        if parallel:
            _loss(model, both(step), head).backward()
        else:
            _dense_step(model, both(step))
        opt.step(), opt.zero_grad()
    expected = dict(_dense(TOTAL).named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dense_slice(model, name, expected[name]), rtol=TOL,
                                   atol=TOL, msg=f"{name} after {TOTAL} steps")
    return dist.get_world_size() if dist.is_initialized() else 1


@pytest.mark.timeout(600)
def test_fsdp2_x_tp_checkpoint_loads_at_tp4_and_into_the_dense_model(tmp_path):
    path = str(tmp_path / "fsdp_tp")
    refusals = run_distributed(_fsdp_tp_save, 4, path, timeout=240)
    for message in refusals:  # a plain state_dict() of the 2-D model names the way out
        assert message is not None and "tensorpar.sharded_state_dict(model)" in message
    assert run_distributed(_resume, 4, path, True, timeout=240) == [4] * 4
    assert run_distributed(_resume, 1, path, False, timeout=240) == [1]
