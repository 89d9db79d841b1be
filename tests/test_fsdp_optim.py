"""The training loop under FSDP2 beside tensor parallelism: optimizer checkpoints that resume
exactly, optimizer.state_dict() refused by DCP, load_full_state_dict, clipping with the
parameters and the replica drift check."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorpar as tp
from tensorpar.errors import CollectiveArgumentError
from tensorpar.nn import plan_from_transformers
from tensorpar.nn.state._params import tag_of
from tensorpar.testing import run_distributed
from tests.test_clip import _dense_step, _loss, build, dense_slice
from tests.test_fsdp_tp import _optimizer, batch, both, load_perturbed

pytest.importorskip("transformers")

TOL = 1e-10
SAVED_AT, TOTAL = 3, 4


def _mesh(dp, tp_size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp_size), mesh_dim_names=("dp", "tp"))


def _fsdp_model(mesh, early_forward=False):
    """``build()`` parallelised over ``tp``, then every block and the root sharded over ``dp``.

    ``early_forward``: run a forward before ``fully_shard`` (FSDP2's parameters are then
    tagged by the first tensorpar function given the model, not at the first forward).
    """
    from torch.distributed.fsdp import fully_shard

    model = tp.parallelize(build(), plan_from_transformers(build()), group=mesh["tp"])
    if early_forward:
        with torch.no_grad():
            model(_ids(mesh, 0))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _ids(mesh, step):
    """This replica's batch: at dp 2 each replica half of ``both(step)``, at dp 1 all of it."""
    return both(step) if mesh.size(0) == 1 else batch(step, mesh.get_local_rank("dp"))


def _step(model, opt, mesh, step, clip=None):
    _loss(model, _ids(mesh, step), model.get_output_embeddings()).backward()
    norm = clip(model, 0.05) if clip is not None else None
    opt.step()
    opt.zero_grad()
    return norm


def _dense(steps, clip=False):
    dense = build()
    opt = _optimizer(dense.parameters())
    norms = []
    for step in range(steps):
        _dense_step(dense, both(step))
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05))
        opt.step(), opt.zero_grad()
    return dense, norms


def _assert_dense(model, steps, dense=None):
    expected = dict((dense or _dense(steps)[0]).named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dense_slice(model, name, expected[name]),
                                   rtol=TOL, atol=TOL, msg=f"{name} after {steps} steps")


def _save(path):
    mesh = _mesh(2, 2)
    model = _fsdp_model(mesh)
    opt = _optimizer(model.parameters())
    for step in range(SAVED_AT):
        _step(model, opt, mesh, step)
    dcp.save({"model": tp.sharded_state_dict(model),
              "optim": tp.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _resume(path, dp, tp_size):
    mesh = _mesh(dp, tp_size)
    model = _fsdp_model(mesh)
    opt = _optimizer(model.parameters())
    load_perturbed(model, opt, path)
    for step in range(SAVED_AT, TOTAL):
        _step(model, opt, mesh, step)
    _assert_dense(model, TOTAL)
    return int(opt.state[next(iter(model.parameters()))]["step"])


@pytest.mark.timeout(300)
def test_fsdp2_x_tp_optimizer_checkpoint_resumes_exactly_at_2x2_and_1x4(tmp_path):
    path = str(tmp_path / "fsdp_optim")
    run_distributed(_save, 4, path, timeout=120)  # the first call may start the ranks
    assert run_distributed(_resume, 4, path, 2, 2, timeout=120) == [TOTAL] * 4
    assert run_distributed(_resume, 4, path, 1, 4, timeout=120) == [TOTAL] * 4


def _raw_optimizer_state_dict(path, early_forward):
    mesh = _mesh(2, 2)
    model = _fsdp_model(mesh, early_forward)
    opt = _optimizer(model.parameters())
    _step(model, opt, mesh, 0, tp.nn.clip_grad_norm_ if early_forward else None)
    state = opt.state_dict()
    moments = [type(s["exp_avg"]).__name__ for s in opt.state.values()]
    untagged = [n for n, p in model.named_parameters() if tag_of(p) is None]
    try:
        dcp.save({"optim": state}, checkpoint_id=path)
        message = None
    except BaseException as e:  # DCP wraps every rank's error in a CheckpointException
        message = str(e)
    return message, sorted(set(moments)), untagged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("early_forward", [False, True])
def test_raw_optimizer_state_dict_of_fsdp2_x_tp_model_is_refused_by_dcp(tmp_path,
                                                                       early_forward):
    for message, moments, untagged in run_distributed(_raw_optimizer_state_dict, 4,
                                            str(tmp_path / "raw"), early_forward, timeout=120):
        assert message is not None, "one tensor-parallel rank's moments were saved"
        assert "tensorpar.sharded_optimizer_state_dict" in message
        assert moments == ["DTensor"], "state_dict() changed the optimizer's own state"
        assert untagged == []  # the root's parameters too (unsharded at the first forward)
    assert not list((tmp_path / "raw").glob("*.metadata"))


def _load_full(steps):
    mesh = _mesh(2, 2)
    dense = _dense(steps)[0]
    model = _fsdp_model(mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    first = mesh.get_local_rank("tp") == 0
    tp.load_full_state_dict(model, dense.state_dict() if first else None, group=mesh["tp"])
    full = tp.full_state_dict(model, group=mesh["tp"])
    if first:
        for key, value in dense.state_dict().items():
            assert torch.equal(full[key], value), key
    opt = _optimizer(model.parameters())  # a fresh optimizer from a dense model's weights:
    _step(model, opt, mesh, 0)             # one step equals the dense model's first
    _assert_dense(model, 1)
    return first


@pytest.mark.timeout(300)
def test_load_full_state_dict_under_fsdp2_x_tp():
    assert run_distributed(_load_full, 4, 0, timeout=120) == [True, False] * 2


def _clip_and_check(clip_kind, steps):
    mesh = _mesh(2, 2)
    model = _fsdp_model(mesh)
    opt = _optimizer(model.parameters())
    if clip_kind == "torch":
        def clip(m, max_norm):
            return torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
    else:
        def clip(m, max_norm):
            return tp.nn.clip_grad_norm_(list(m.parameters()), max_norm)
    norms, done = [], 0
    with tp.validation(True):
        try:
            for step in range(steps):
                norms.append(_step(model, opt, mesh, step, clip))
                done += 1
        except CollectiveArgumentError as e:
            return done, str(e)
    dense, expected = _dense(steps, clip=True)
    for got, want in zip(norms, expected, strict=True):
        assert float(want) > 0.05  # every step clips
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    _assert_dense(model, steps, dense)
    return done, None


@pytest.mark.timeout(300)
def test_drift_check_under_fsdp2_catches_torch_clip_at_the_first_step():
    for done, message in run_distributed(_clip_and_check, 4, "torch", 1, timeout=120):
        assert done == 0, "the drifted replicas were not caught at the first step"
        assert message is not None and "replicated parameter 'model." in message
        assert "tensorpar.nn.clip_grad_norm_" in message


@pytest.mark.timeout(300)
def test_clip_with_the_parameters_under_fsdp2_equals_dense_and_stays_silent():
    assert run_distributed(_clip_and_check, 4, "tensorpar", 5, timeout=120) == [(5, None)] * 4
