"""Optimizer state in sharded checkpoints: save at one TP size, resume at another or dense."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorpar as tp
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _dense_step, _loss, build, dense_slice, tokens

pytest.importorskip("transformers")

TOL = 1e-10
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),
}


def _parallel_model():
    return tp.parallelize(build(), plan_from_transformers(build()))


def _train(model, opt, steps, parallel):
    head = model.get_output_embeddings()
    for step in steps:
        if parallel:
            _loss(model, tokens(step), head).backward()
        else:
            _dense_step(model, tokens(step))
        opt.step()
        opt.zero_grad()


def _save(path, kind, steps, parallel=True):
    model = _parallel_model() if parallel else build()
    opt = OPTIMIZERS[kind](model.parameters())
    _train(model, opt, range(steps), parallel=parallel)
    dcp.save({"model": tp.sharded_state_dict(model),
              "optim": tp.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _resume(path, kind, steps, total, parallel):
    """Load (fresh model and optimizer, other weights), train on; compare with dense."""
    torch.manual_seed(1)
    model = _parallel_model() if parallel else build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing of the fresh model may survive the load
    opt = OPTIMIZERS[kind](model.parameters())
    state = {"model": tp.sharded_state_dict(model),
             "optim": tp.sharded_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state["model"])
    tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    _train(model, opt, range(steps, total), parallel)
    dense = build()
    dense_opt = OPTIMIZERS[kind](dense.parameters())
    _train(dense, dense_opt, range(total), parallel=False)
    expected = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dense_slice(model, name, expected[name]), rtol=TOL,
                                   atol=TOL, msg=f"{kind}: {name} after {total} steps")
    return True


@pytest.mark.timeout(600)
def test_adamw_saved_at_tp2_resumes_at_tp3_and_dense_like_five_dense_steps(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path, "adamw", 2, timeout=120)
    assert all(run_distributed(_resume, 3, path, "adamw", 2, 5, True, timeout=120))
    assert all(run_distributed(_resume, 1, path, "adamw", 2, 5, False, timeout=120))


@pytest.mark.timeout(600)
def test_the_dense_models_checkpoint_resumes_a_tp3_run(tmp_path):
    path = str(tmp_path / "dense")
    run_distributed(_save, 1, path, "adamw", 2, False, timeout=120)
    assert all(run_distributed(_resume, 3, path, "adamw", 2, 5, True, timeout=120))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["adam", "sgd", "adagrad", "rmsprop"])
def test_other_optimizers_resume_at_another_tp_size(tmp_path, kind):
    path = str(tmp_path / kind)
    run_distributed(_save, 3, path, kind, 1, timeout=120)
    assert all(run_distributed(_resume, 2, path, kind, 1, 2, True, timeout=120))




def _direct_optimizer_state_dict(path):
    model = _parallel_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1), parallel=True)
    try:
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    except BaseException as e:  # DCP wraps every rank's error in a CheckpointException
        return str(e)
    return None


def test_optimizer_state_dict_handed_to_dcp_directly_raises_on_every_rank(tmp_path):
    results = run_distributed(_direct_optimizer_state_dict, 2, str(tmp_path / "d"))
    for message in results:
        assert message is not None, "one rank's optimizer shards were saved"
        assert "tensorpar.sharded_optimizer_state_dict" in message
    assert not list((tmp_path / "d").glob("*.metadata"))


# -- a checkpoint of another model ------------------------------------------------------------

def _blocks(count):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
                                 for _ in range(count))).double()


def _deeper_into_shallower(path, pipelined, blocks=5):
    """Model and AdamW state of 7 blocks saved; loaded into ``blocks`` blocks (pipelined: 2
    stages); 7 blocks: the same model, its first block now frozen (out of the optimizer)."""
    def build_pair(count, frozen=False):
        model = _blocks(count)
        if pipelined:
            model = tp.nn.pipeline(model, microbatches=2,
                                   loss_fn=lambda out, y: out.square().mean())
        trained = [p for n, p in model.named_parameters() if not (frozen and n[0] == "0")]
        return model, torch.optim.AdamW(trained, lr=1e-2)

    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model, opt = build_pair(7)
    if pipelined:
        model.step(x if model.is_first else None, x if model.is_last else None)
    else:
        model(x).square().mean().backward()
    opt.step()
    dcp.save({"model": tp.sharded_state_dict(model),
              "optim": tp.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    smaller, smaller_opt = build_pair(blocks, frozen=blocks == 7)
    state = {"model": tp.sharded_state_dict(smaller),
             "optim": tp.sharded_optimizer_state_dict(smaller, smaller_opt)}
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(smaller, state["model"])  # as DCP: extra keys are not read
    try:
        tp.load_sharded_optimizer_state_dict(smaller, smaller_opt, state["optim"])
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize("pipelined", [False, True], ids=["dense", "pipeline"])
def test_optimizer_state_of_a_deeper_model_is_refused_on_every_rank(tmp_path, pipelined):
    """Loaded into a shallower model it was cut to fit, silently (the model state is DCP's:
    a key the model does not ask for is not read)."""
    results = run_distributed(_deeper_into_shallower, 2, str(tmp_path / "c"), pipelined,
                              timeout=60)
    for message in results:
        assert "parameter(s) this model does not have" in message, message
        assert "'5.0.weight'" in message, message


@pytest.mark.parametrize("pipelined", [False, True], ids=["dense", "pipeline"])
def test_optimizer_state_of_parameters_frozen_since_loads(tmp_path, pipelined):
    """Fine-tuning: the checkpoint's state for a parameter now out of the optimizer."""
    results = run_distributed(_deeper_into_shallower, 2, str(tmp_path / "frozen"), pipelined,
                              7, timeout=60)
    assert results == ["loaded", "loaded"], results
