"""Pipeline parallelism composed: tensor parallelism inside a stage (pp x tp), clipping over
the whole pipeline, sharded checkpoints in dense names across pipeline sizes."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar
import tensorpar as tp
from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy
from tensorpar.testing import run_distributed
from tests.test_clip import dense_slice
from tests.test_pipeline import batch, sequential
from tests.test_pipeline_hf import llama, lm_loss, tokens

pytest.importorskip("transformers")

TOL = 1e-10


def mesh_groups(pp, tp_size):
    """pp x tp on the world: tp groups are consecutive ranks, pp groups strided."""
    rank = dist.get_rank()
    tp_group = pp_group = None
    for i in range(pp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(i * tp_size, (i + 1) * tp_size)))
        if rank // tp_size == i:
            tp_group = g
    for j in range(tp_size):
        g = dist.new_group(list(range(j, pp * tp_size, tp_size)))
        if rank % tp_size == j:
            pp_group = g
    return pp_group, tp_group


def _step_error(pipe, inputs, target):
    """The ValueError one step raises on this rank, or "no error"."""
    try:
        pipe.step(inputs if pipe.is_first else None, target if pipe.is_last else None)
    except ValueError as e:
        return str(e)
    return "no error"


def _pp_tp_matches_dense(order, family="llama", schedule="1f1b"):
    pp_group, tp_group = mesh_groups(2, 2)
    dense = llama(family=family)
    model = llama(family=family)

    def vocab_parallel_loss(local_logits, labels):  # (B, T, V/tp): the head's slice
        return vocab_parallel_cross_entropy(local_logits[:, :-1].flatten(0, 1),
                                            labels[:, 1:].flatten(), group=tp_group)

    if order == "tp-first":  # vocab-parallel head: the loss never gathers the logits
        tp.parallelize(model, plan_from_transformers(llama(family=family)), group=tp_group)
        pipe = tp.nn.pipeline(model, group=pp_group, microbatches=3,
                              loss_fn=vocab_parallel_loss, schedule=schedule)
    else:  # gathered head: any loss on whole logits
        pipe = tp.nn.pipeline(model, group=pp_group, microbatches=3, loss_fn=lm_loss,
                              schedule=schedule)
        tp.parallelize(pipe, plan_from_transformers(llama(family=family), lm_head="gathered"),
                       group=tp_group)
    sharded = [n for n, m in pipe.named_modules() if getattr(m, "sharded_dims", None)]
    assert sharded, "tensor parallelism was not applied"
    for step, length in enumerate((9, 5)):
        ids = tokens(step, length=length)
        loss = pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None)
        dense_loss = lm_loss(dense(ids).logits, ids)
        dense_loss.backward()
        if pipe.is_last:
            torch.testing.assert_close(loss, dense_loss.detach(), rtol=TOL, atol=TOL)
        grads = dict(dense.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, dense_slice(pipe, name, grads[name].grad),
                                       rtol=TOL, atol=TOL, msg=f"step {step}: {name}")
        # the norm over the whole pipeline (every stage, shards reduced once) is dense's
        norm = tp.nn.grad_norm(pipe)
        torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(
            [p.grad for p in dense.parameters()]), rtol=TOL, atol=TOL)
        pipe.zero_grad(), dense.zero_grad()
    return len(sharded)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order,family,schedule", [
    ("tp-first", "llama", "1f1b"), ("pp-first", "llama", "1f1b"), ("tp-first", "qwen2", "1f1b"),
    ("pp-first", "mistral", "1f1b"), ("tp-first", "llama", "zero-bubble"),
    ("pp-first", "llama", "zero-bubble")])
def test_pp2_x_tp2_equals_dense(order, family, schedule):
    # qwen2 and mistral with sliding windows shorter than the sequences
    counts = run_distributed(_pp_tp_matches_dense, 4, order, family, schedule, timeout=220)
    assert all(c > 0 for c in counts)


def _clip_matches_dense(norm_type, frozen_first_stage=False):
    dense, model = sequential(), sequential()
    split = None
    if frozen_first_stage:  # a rank with no gradient at all: its blocks 0 and 1 frozen
        split = [2, 5] if dist.get_world_size() == 2 else [2, 3, 2]
        for m in (dense, model):
            m[:2].requires_grad_(False)
    pipe = tp.nn.pipeline(model, microbatches=3, loss_fn=F.mse_loss, split=split)
    x, y = batch(7, 0)
    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    F.mse_loss(dense(x), y).backward()
    norm = tp.nn.clip_grad_norm_(pipe, 0.01, norm_type)
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.01, norm_type)
    torch.testing.assert_close(norm, dense_norm, rtol=TOL, atol=TOL)
    grads = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_over_the_whole_pipeline(norm_type, world_size):
    run_distributed(_clip_matches_dense, world_size, norm_type, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), float("-inf"), 0.0, 0.5])
def test_clip_over_a_pipeline_with_a_frozen_stage(norm_type):
    """A rank whose stage has no gradient: its norm was a float32 zero (gloo aborted beside
    the others' float64 ones) and, for -inf, the minimum over the stages (0, silently)."""
    run_distributed(_clip_matches_dense, 2, norm_type, True, timeout=100)
    run_distributed(_clip_matches_dense, 3, norm_type, True, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), float("-inf")])
def test_clip_over_a_pipeline_with_no_gradient_anywhere(norm_type):
    """Before any step no stage has a gradient: torch's norm of none is 0 for every norm
    type (the stages' -inf norms meet in a minimum, whose identity is infinity)."""
    run_distributed(_clip_before_any_step, 2, norm_type, timeout=100)
    run_distributed(_clip_before_any_step, 3, norm_type, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), float("-inf"), 0.0])
def test_clip_over_a_pipeline_with_a_stage_without_parameters(norm_type):
    """The middle stage holds two Tanh blocks only: its norm had no dtype but float32's, and
    gloo aborted the job meeting the float64 stages' norms."""
    run_distributed(_clip_with_a_parameterless_stage, 3, norm_type, timeout=100)


@pytest.mark.timeout(120)
def test_a_parameterless_stage_raises_where_the_others_do():
    """float16 stages whose norm overflows: the parameterless stage kept the float64 norm and
    went on while the others raised (error_if_nonfinite), then waited for ever."""
    for outcome in run_distributed(_nonfinite_with_a_parameterless_stage, 3, timeout=100):
        assert outcome == "raised", outcome


def _nonfinite_with_a_parameterless_stage():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(1, 1, bias=False)).half()
    pipe = tp.nn.pipeline(model, microbatches=1, loss_fn=F.mse_loss, split=[1, 1, 1])
    for p in pipe.parameters():
        p.grad = torch.full_like(p, 50000.0)
    try:
        tp.nn.clip_grad_norm_(pipe, 1.0, error_if_nonfinite=True)
    except RuntimeError:
        return "raised"
    return "went on"


def _mixed_or_nan_stages(norm_type, case):
    """Two stages: float16 beside float32 (the float16 stage cast the norm to inf, alone),
    or a nan gradient on stage 1 (gloo's max and min dropped it: a finite norm)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False),
                                    torch.nn.Linear(4, 4, bias=False))
        if case == "mixed":
            model[0].half()
        return model

    pipe = tp.nn.pipeline(build(), microbatches=1, loss_fn=F.mse_loss, split=[1, 1])
    dense = build()
    for m in (pipe, dense):
        for name, q in m.named_parameters():
            q.grad = torch.full_like(q, 10.0 if name.startswith("0") else 3e4)
            if case == "nan" and name.startswith("1"):
                q.grad[0, 0] = math.nan
    got = tp.nn.clip_grad_norm_(pipe, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0, norm_type)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, -math.inf])
@pytest.mark.parametrize("case", ["mixed", "nan"])
def test_stages_of_other_dtypes_or_a_nan_norm_give_torch_s_norm_everywhere(case, norm_type):
    run_distributed(_mixed_or_nan_stages, 2, norm_type, case, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [-1.0, -0.5])
def test_a_negative_norm_type_leaves_out_a_stage_without_gradients(norm_type):
    """A stage with no gradient added 0 ** p = inf to the stages' sum: the norm was 0."""
    run_distributed(_clip_matches_dense, 2, norm_type, True, timeout=100)
    run_distributed(_clip_matches_dense, 3, norm_type, True, timeout=100)


def _clip_with_a_parameterless_stage(norm_type):
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 3)).double()

    dense = build()
    pipe = tp.nn.pipeline(build(), microbatches=2, loss_fn=F.mse_loss, split=[1, 2, 1])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
    F.mse_loss(dense(x), y).backward()
    norm = tp.nn.clip_grad_norm_(pipe, 0.01, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.01, norm_type)
    torch.testing.assert_close(norm.double(), expected, rtol=TOL, atol=TOL)
    grads = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL, msg=name)


def _clip_before_any_step(norm_type):
    dense = sequential()
    pipe = tp.nn.pipeline(sequential(), microbatches=3, loss_fn=F.mse_loss)
    expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.01, norm_type)
    got = tp.nn.clip_grad_norm_(pipe, 0.01, norm_type)
    assert torch.equal(got, expected.to(got.dtype)), (got, expected)


# ---------------------------------------------------------------------------------------
# sharded checkpoints in dense names: saved at one pipeline size, loaded at another
# ---------------------------------------------------------------------------------------

def _build(kind, seed):
    if kind == "sequential":
        return sequential(seed)
    torch.manual_seed(seed)
    model = llama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # other weights than llama()'s
    return model


def _save(kind, path, tp_size):
    import torch.distributed.checkpoint as dcp

    pp_group, tp_group = mesh_groups(dist.get_world_size() // tp_size, tp_size)
    model = _build(kind, 1)
    if tp_size > 1:
        tp.parallelize(model, plan_from_transformers(llama()), group=tp_group)
    pipe = tp.nn.pipeline(model, group=pp_group, microbatches=2,
                          loss_fn=F.mse_loss if kind == "sequential" else lm_loss)
    dcp.save(tp.sharded_state_dict(pipe), checkpoint_id=path)


def _load(kind, path):
    import torch.distributed.checkpoint as dcp

    pipe = tp.nn.pipeline(_build(kind, 0), microbatches=2,
                          loss_fn=F.mse_loss if kind == "sequential" else lm_loss)
    state = tp.sharded_state_dict(pipe)
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(pipe, state)
    saved = dict(_build(kind, 1).named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0, msg=name)
    return [name for name, _ in pipe.named_parameters()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,tp_size", [("sequential", 1), ("llama", 2)])
def test_checkpoint_saved_at_pp2_loads_at_pp3_and_dense(kind, tp_size, tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2 * tp_size, kind, path, tp_size, timeout=200)
    held = run_distributed(_load, 3, kind, path, timeout=200)
    names = {name for name, _ in _build(kind, 1).named_parameters()}
    assert sorted(n for r in held for n in r) == sorted(names)
    dense = _build(kind, 0)
    state = dense.state_dict()
    dcp.load(state, checkpoint_id=path)  # one process, no process group: the dense model
    dense.load_state_dict(state)
    for name, p in _build(kind, 1).named_parameters():
        torch.testing.assert_close(dense.get_parameter(name), p, rtol=0, atol=0, msg=name)


def _dp_x_pp_matches_dense(schedule):
    pp_group, dp_group = mesh_groups(2, 2)  # dp ranks consecutive, pp ranks strided
    replica = dist.get_rank(dp_group)
    dense = sequential()
    pipe = tp.nn.pipeline(sequential(), group=pp_group, microbatches=3, loss_fn=F.mse_loss,
                          schedule=schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    for step in range(2):
        x, y = batch(12, step)  # each replica takes its half of the batch
        mine = slice(6 * replica, 6 * replica + 6)
        pipe.step(x[mine] if pipe.is_first else None, y[mine] if pipe.is_last else None)
        tensorpar.pipeline.average_gradients(pipe, group=dp_group)
        F.mse_loss(dense(x), y).backward()
        grads = dict(dense.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL, msg=name)
        opt.step(), dense_opt.step(), opt.zero_grad(), dense_opt.zero_grad()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_data_parallel_pipeline_replicas_equal_dense(schedule):
    run_distributed(_dp_x_pp_matches_dense, 4, schedule, timeout=100)


def _fsdp_x_pp_matches_dense(virtual):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    dense = sequential()
    pipe = tp.nn.pipeline(sequential(), group=mesh.get_group("pp"), microbatches=4,
                          loss_fn=F.mse_loss, virtual_stages=virtual)
    for _, module in pipe.stage_modules():  # FSDP2 over the replicas, block by block
        fully_shard(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    reduce_scatters = []
    # FSDP2 calls one of these, by the torch version (looked up on the module at each call)
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):
        def counted(*args, **kwargs):
            reduce_scatters.append(name)
            return originals[name](*args, **kwargs)
        return counted

    for name in names:
        setattr(dist, name, counting(name))
    try:
        for step in range(2):
            x, y = batch(12, step)  # each replica takes its half of the batch
            mine = slice(6 * replica, 6 * replica + 6)
            pipe.step(x[mine] if pipe.is_first else None, y[mine] if pipe.is_last else None)
            F.mse_loss(dense(x), y).backward()
            grads = dict(dense.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, rtol=TOL,
                                           atol=TOL, msg=name)
            torch.testing.assert_close(tp.nn.grad_norm(pipe), torch.nn.utils.get_total_norm(
                [p.grad for p in dense.parameters()]), rtol=TOL, atol=TOL)
            opt.step(), dense_opt.step(), opt.zero_grad(), dense_opt.zero_grad()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    params = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.full_tensor(), params[name], rtol=TOL, atol=TOL, msg=name)
    return len(reduce_scatters), len(pipe.stage_modules())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("virtual", [1, 2])
def test_fsdp2_across_pipeline_replicas_equals_dense(virtual):
    # 4 ranks: 2 replicas x 2 stages; each block reduce-scatters once per step (in its
    # stage's last backward), not once per microbatch
    for calls, blocks in run_distributed(_fsdp_x_pp_matches_dense, 4, virtual, timeout=100):
        assert calls == 2 * blocks


def _fsdp_on_the_pipeline_itself_raises():
    from torch.distributed.fsdp import fully_shard

    pipe = tp.nn.pipeline(sequential(), microbatches=2, loss_fn=F.mse_loss)
    fully_shard(pipe)
    return _step_error(pipe, *batch(4, 0))


def _fsdp_with_zero_bubble_raises():
    from torch.distributed.fsdp import fully_shard

    pipe = tp.nn.pipeline(sequential(), microbatches=2, loss_fn=F.mse_loss,
                          schedule="zero-bubble")
    for _, module in pipe.stage_modules():
        fully_shard(module)
    return _step_error(pipe, *batch(4, 0))


@pytest.mark.timeout(60)
def test_fsdp2_with_zero_bubble_raises_on_every_rank():
    # FSDP2 reduces a module's gradients when its backward ends: before the W half
    for message in run_distributed(_fsdp_with_zero_bubble_raises, 2, timeout=50):
        assert "schedule='zero-bubble' computes the weights' gradients" in message


def _reducer_with_zero_bubble(kind):
    pp_group, dp_group = mesh_groups(2, 2)  # (pp groups strided: replicas of a stage)
    pipe = tp.nn.pipeline(sequential(), group=pp_group, microbatches=3, loss_fn=F.mse_loss,
                          schedule="zero-bubble")
    if kind == "reducer":
        tp.BucketedAllReduce(pipe, group=dp_group)
    else:
        tp.nn.DistributedDataParallel(pipe, process_group=dp_group)
    return _step_error(pipe, *batch(6, 0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["reducer", "wrapper"])
def test_a_data_parallel_reducer_with_zero_bubble_raises_on_every_rank(kind):
    # the W half writes .grad itself: the reducer's hooks never ran, and the later stages
    # kept their replica's own gradients (0.22 off dense), silently
    for message in run_distributed(_reducer_with_zero_bubble, 4, kind, timeout=100):
        assert "would not be averaged" in message and "has one" in message


def _sequence_parallel_stage():
    pp_group, tp_group = mesh_groups(2, 2)
    model = llama()
    tp.parallelize(model, plan_from_transformers(llama(), lm_head="gathered",
                                                 sequence_parallel=True), group=tp_group)
    pipe = tp.nn.pipeline(model, group=pp_group, microbatches=2, loss_fn=lm_loss)
    ids = tokens(0, length=9)
    return _step_error(pipe, ids, ids)


@pytest.mark.timeout(120)
def test_sequence_parallelism_inside_a_stage_raises_on_every_rank():
    # the next stage could not tell the split: it raised "a gather ran before any
    # SequenceSplit" (pointing at the plan) and the first stage "no gradient came"
    for message in run_distributed(_sequence_parallel_stage, 4, timeout=100):
        assert "planned with sequence parallelism" in message


@pytest.mark.timeout(60)
def test_fsdp2_on_the_pipeline_itself_raises_on_every_rank():
    for message in run_distributed(_fsdp_on_the_pipeline_itself_raises, 2, timeout=50):
        assert "'the pipeline itself'" not in message  # named without quotes
        assert "fully_shard was applied to the pipeline itself" in message
        assert "pipe.stage_modules()" in message


def _fsdp_x_pp_llama(shard_decoder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    dense = llama()
    pipe = tp.nn.pipeline(llama(), group=mesh.get_group("pp"), microbatches=2, loss_fn=lm_loss)
    for _, module in pipe.stage_modules():
        fully_shard(module, mesh=mesh["dp"])
    if shard_decoder:  # the decoder's own forward never runs: refused, on every rank
        fully_shard(pipe.model, mesh=mesh["dp"])
    ids = tokens(0, batch=8)
    mine = ids[4 * replica:4 * replica + 4]
    try:
        loss = pipe.step(mine if pipe.is_first else None, mine if pipe.is_last else None)
    except ValueError as e:
        return str(e)
    dense_loss = lm_loss(dense(ids).logits, ids)
    dense_loss.backward()
    grads = dict(dense.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, rtol=TOL, atol=TOL,
                                   msg=name)
    if pipe.is_last:  # this replica's half of the batch (equal token counts)
        half = lm_loss(dense(mine).logits, mine)
        torch.testing.assert_close(loss, half.detach(), rtol=TOL, atol=TOL)
    return sorted(name for name, _ in pipe.stage_modules())


@pytest.mark.timeout(180)
def test_fsdp2_across_replicas_of_a_llama_pipeline_equals_dense():
    held = run_distributed(_fsdp_x_pp_llama, 4, False, timeout=150)
    assert "model.embed_tokens" in held[0] and "lm_head" in held[1]  # pp ranks 0 and 1
    messages = run_distributed(_fsdp_x_pp_llama, 4, True, timeout=150)
    assert all("fully_shard was applied to 'model'" in m for m in messages)


def _own_loss_on_vocab_parallel_head_raises():
    pp_group, tp_group = mesh_groups(2, 2)
    model = tp.parallelize(llama(), plan_from_transformers(llama()), group=tp_group)
    pipe = tp.nn.pipeline(model, group=pp_group, microbatches=2)  # the model's own loss
    return _step_error(pipe, tokens(0), tokens(0))


@pytest.mark.timeout(120)
def test_own_loss_on_a_vocab_parallel_head_raises_on_every_rank():
    messages = run_distributed(_own_loss_on_vocab_parallel_head_raises, 4, timeout=100)
    assert all("vocab-parallel" in m for m in messages[2:])  # the last stage's ranks
    assert all("another rank" in m for m in messages[:2])


# ---------------------------------------------------------------------------------------
# the optimizer's state across pipeline sizes and the dense model (tied weights included)
# ---------------------------------------------------------------------------------------

def _train_steps(model, step_fn, opt, steps):
    for step in steps:
        step_fn(model, step)
        opt.step()
        opt.zero_grad()


def _dense_step(model, step):
    ids = tokens(step)
    lm_loss(model(ids).logits, ids).backward()


def _pipe_step(pipe, step):
    ids = tokens(step)
    pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None)


def _optim_state(model, opt):
    return {"model": tp.sharded_state_dict(model),
            "optim": tp.sharded_optimizer_state_dict(model, opt)}


def _save_trained(path, pipelined, steps):
    """``steps`` AdamW steps of a tied Llama (a pipeline over the world, or dense), saved."""
    import torch.distributed.checkpoint as dcp

    model = llama(tied=True)
    if pipelined:
        model = tp.nn.pipeline(model, microbatches=2, loss_fn=lm_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train_steps(model, _pipe_step if pipelined else _dense_step, opt, range(steps))
    dcp.save(_optim_state(model, opt), checkpoint_id=path)


def _resume(path, pipelined, start, total):
    """Load into a fresh tied Llama (pipeline or dense) and its AdamW; train to ``total``."""
    import torch.distributed.checkpoint as dcp

    model = llama(tied=True)
    with torch.no_grad():  # other weights: the checkpoint must bring them back
        for p in model.parameters():
            p.add_(1.0)
    if pipelined:
        model = tp.nn.pipeline(model, microbatches=2, loss_fn=lm_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # the checkpoint's lr comes back
    state = _optim_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state["model"])
    tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    _train_steps(model, _pipe_step if pipelined else _dense_step, opt, range(start, total))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_like_dense_run(got, total):
    dense = llama(tied=True)
    opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    _train_steps(dense, _dense_step, opt, range(total))
    want = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.timeout(300)
def test_optimizer_state_saved_at_pp2_resumes_at_pp3_and_in_the_dense_model(tmp_path):
    """Two AdamW steps at PP 2, saved; a third at PP 3 and in the dense model equals a dense
    run of three (the pipeline's ranks hold other parameter groups' names: the checkpoint
    kept one rank's list, and the dense model's load refused it)."""
    path = str(tmp_path / "pp2")
    run_distributed(_save_trained, 2, path, True, 2, timeout=200)
    for held in run_distributed(_resume, 3, path, True, 2, 3, timeout=200):
        _assert_like_dense_run(held, 3)
    _assert_like_dense_run(_resume(path, False, 2, 3), 3)


@pytest.mark.timeout(300)
def test_a_dense_optimizer_checkpoint_resumes_a_pipeline_with_tied_weights(tmp_path):
    """The dense optimizer holds a tied embedding and head once; a pipeline's last stage
    holds the head as a parameter of its own, whose state the checkpoint must carry."""
    path = str(tmp_path / "dense")
    _save_trained(path, False, 2)
    for held in run_distributed(_resume, 2, path, True, 2, 3, timeout=200):
        _assert_like_dense_run(held, 3)


def _two_groups(model, swapped=False):
    """AdamW with weight decay on the matrices and none on the vectors (norms)."""
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups[::-1] if swapped else groups, lr=0.01)


def _save_grouped(path):
    import torch.distributed.checkpoint as dcp

    pipe = tp.nn.pipeline(llama(tied=True), microbatches=2, loss_fn=lm_loss)
    opt = _two_groups(pipe)
    _train_steps(pipe, _pipe_step, opt, range(1))
    state = _optim_state(pipe, opt)
    dcp.save(state, checkpoint_id=path)
    return [list(g["params"]) for g in state["optim"]["param_groups"]]


def _load_grouped(path, pipelined, swapped):
    import torch.distributed.checkpoint as dcp

    model = llama(tied=True)
    if pipelined:
        model = tp.nn.pipeline(model, microbatches=2, loss_fn=lm_loss)
    opt = _two_groups(model, swapped)
    state = _optim_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    try:
        tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    except ValueError as e:
        return str(e)
    return [g["weight_decay"] for g in opt.param_groups]


@pytest.mark.timeout(300)
def test_a_pipelines_groups_list_every_stage_and_a_group_out_of_order_is_refused(tmp_path):
    """The groups of a PP 2 checkpoint list every stage's names (each rank's optimizer holds
    its own stage's); loaded with the groups in another order, a weight would take the
    other group's options (its weight decay): refused, in the dense model and at PP 3."""
    path = str(tmp_path / "grouped")
    saved = run_distributed(_save_grouped, 2, path, timeout=200)
    dense = llama(tied=True)
    names = [n for n, p in dense.named_parameters()]
    assert saved[0] == saved[1]
    assert sorted(saved[0][0] + saved[0][1]) == sorted(names)
    assert _load_grouped(path, False, False) == [0.1, 0.0]
    assert "in another group" in _load_grouped(path, False, True)
    for got in run_distributed(_load_grouped, 3, path, True, True, timeout=200):
        assert "in another group" in got, got
    assert run_distributed(_load_grouped, 3, path, True, False, timeout=200) == [[0.1, 0.0]] * 3


def test_a_dense_tied_model_saves_the_pair_once():
    """The dense optimizer's state holds a tied embedding and head once, under the first
    name: checkpoints written before pipelines read them load as they are."""
    model = llama(tied=True)
    state = tp.sharded_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    assert "model.embed_tokens.weight" in state["state"]
    assert "lm_head.weight" not in state["state"]


def _state_dict_error(case):
    pipe = tp.nn.pipeline(llama(tied=True), microbatches=2, loss_fn=lm_loss)
    named = list(pipe.named_parameters())
    if case == "tied copies split":  # the head's copy without decay, the embedding's with
        groups = [{"params": [p for n, p in named if "lm_head" not in n]},
                  {"params": [p for n, p in named if "lm_head" in n], "weight_decay": 0.0}]
    else:  # rank 1's optimizer holds a parameter that is not the pipeline's
        extra = [torch.nn.Parameter(torch.zeros(2))] if dist.get_rank() == 1 else []
        groups = [{"params": [p for _, p in named] + extra}]
    try:
        tp.sharded_optimizer_state_dict(pipe, torch.optim.AdamW(groups))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["tied copies split", "a foreign parameter on one rank"])
def test_a_pipelines_optimizer_state_dict_refuses_on_every_rank(case):
    """Refused on every rank (the names' all-gather is where the ranks meet): a tied
    weight's two copies in different groups (resuming would refuse the checkpoint on one
    rank), or one rank's own error (the others waited in the all-gather)."""
    got = run_distributed(_state_dict_error, 2, case, timeout=60)
    if case == "tied copies split":
        assert all("'model.embed_tokens.weight' is in group" in m for m in got), got
    else:
        assert "not a parameter of the model" in got[1], got
        assert "rank(s) [1] of the pipeline raised" in got[0], got
