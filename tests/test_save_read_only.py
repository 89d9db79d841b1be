"""Saving never changes a run: a checkpoint taken at any step leaves the optimizer as it was.

Each case trains the same model three times, five steps each: once without saving, once
saving after step ``save_at`` (0 = before the first step) and training on, and once from a
fresh model and optimizer that load that checkpoint and train on. A parameter gets no
gradient in the first step (its state does not exist yet when step 1's checkpoint is taken),
one parameter is frozen throughout, and the optimizer has two parameter groups. Every
parameter after every later step must be bit-identical across the three runs.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorpar as tp
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _dense_step, _loss, build, tokens

pytest.importorskip("transformers")

STEPS = 5
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.05),
    "sgd_momentum_wd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9,
                                                      weight_decay=0.01),
}
LATE = "model.layers.1.mlp.down_proj.weight"  # no gradient in the first step
FROZEN = "model.norm.weight"                   # never a gradient


def _setup(kind, parallel):
    model = build()
    if parallel:
        tp.parallelize(model, plan_from_transformers(build()))
    params = dict(model.named_parameters())
    params[FROZEN].requires_grad_(False)
    norms = [p for n, p in params.items() if "norm" in n]
    rest = [p for n, p in params.items() if "norm" not in n]
    opt = OPTIMIZERS[kind]([{"params": rest}, {"params": norms, "weight_decay": 0.0}])
    return model, opt


def _step(model, opt, step, parallel):
    ids = tokens(step)
    if parallel:
        _loss(model, ids, model.get_output_embeddings()).backward()
    else:
        _dense_step(model, ids)
    if step == 0:
        model.get_parameter(LATE).grad = None  # a branch no data reached this step
    opt.step()
    opt.zero_grad()


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state(model, opt):
    return {"model": tp.sharded_state_dict(model),
            "optim": tp.sharded_optimizer_state_dict(model, opt)}


def _assert_identical(got, want, what):
    for name, value in want.items():
        assert torch.equal(got[name], value), \
            f"{what}: {name} differs by {(got[name] - value).abs().max().item():.3e}"


def _runs(kind, parallel, root):
    """Train without saving, with a save at 0 and at 1, and resumed from each save."""
    model, opt = _setup(kind, parallel)
    plain = []
    for step in range(STEPS):
        _step(model, opt, step, parallel)
        plain.append(_snapshot(model))
    for save_at in (0, 1):
        path = f"{root}/{kind}_{save_at}"
        model, opt = _setup(kind, parallel)
        for step in range(STEPS):
            if step == save_at:
                stated = len(opt.state)
                dcp.save(_state(model, opt), checkpoint_id=path)
                assert len(opt.state) == stated, \
                    f"{kind}: saving created optimizer state"
            _step(model, opt, step, parallel)
            _assert_identical(_snapshot(model), plain[step],
                              f"{kind}: saved before step {save_at + 1}, after step {step + 1}")
        model, opt = _setup(kind, parallel)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # nothing of the fresh model may survive the load
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=path)
        tp.load_sharded_state_dict(model, state["model"])
        tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])
        for step in range(save_at, STEPS):
            _step(model, opt, step, parallel)
            _assert_identical(_snapshot(model), plain[step],
                              f"{kind}: resumed at step {save_at + 1}, after step {step + 1}")
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "kind"), [
    (2, "adamw"), (3, "sgd_momentum_wd"),  # the fast tier
    *(pytest.param(w, k, marks=pytest.mark.slow) for w in (1, 2, 3) for k in sorted(OPTIMIZERS)
      if (w, k) not in ((2, "adamw"), (3, "sgd_momentum_wd")))])
def test_saving_leaves_the_run_bit_identical_and_resumes_it(tmp_path, world, kind):
    root = str(tmp_path)
    assert all(run_distributed(_runs, world, kind, world > 1, root, timeout=240))


def test_saving_an_optimizer_that_never_stepped_fires_no_step_hooks():
    """The state a parameter will have is learned from a throwaway optimizer's step: torch's
    global step hooks (a step counter, a logger, weight averaging) must not see it."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fired = []
    handles = [register_optimizer_step_pre_hook(lambda opt, *a: fired.append("pre")),
               register_optimizer_step_post_hook(lambda opt, *a: fired.append("post"))]
    try:
        state = tp.sharded_optimizer_state_dict(model, optimizer)
        assert state["state"], "the state of the parameters that have none yet is saved"
        assert fired == [], fired
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # the hooks are still there, in their order
        assert fired == ["pre", "post"], fired
    finally:
        for handle in handles:
            handle.remove()
