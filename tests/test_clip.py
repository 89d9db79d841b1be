"""tensorpar.nn.clip_grad_norm_ on tensor-parallel models equals torch's on the dense model."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

VOCAB = 101
# GQA (10 query heads on 5 key/value heads: uneven at TP 2 and 3), tied embeddings,
# vocab 101 and MLP 50 uneven at every TP size
CONFIG = {"vocab_size": VOCAB, "hidden_size": 30, "intermediate_size": 50,
          "num_hidden_layers": 2, "max_position_embeddings": 64, "num_attention_heads": 10,
          "num_key_value_heads": 5, "head_dim": 2, "tie_word_embeddings": True}
NORM_TYPES = {2: (2.0, math.inf, 0.0, 0.5), 3: (2.0, math.inf, 1.0, 3.0)}
STEPS, TOL = 5, 1e-10


def build():
    import transformers

    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def tokens(seed, batch=2, n=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g)


def dense_slice(model, name, dense_tensor):
    """The slice of a dense tensor that the parallel model's parameter ``name`` holds."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    dim = getattr(module, "sharded_dims", {}).get(leaf)
    if dim is None:
        return dense_tensor
    return torch.cat([dense_tensor.narrow(dim, start, n) for start, _, n in module.shard.pieces],
                     dim)


def max_norm_for(norm_type):
    """Small enough that every step clips (the fractional norms are large, p = 0 counts)."""
    return {0.0: 5.0, 0.5: 100.0}.get(norm_type, 0.05)


def _loss(model, ids, head):
    target = ids.roll(-1, 1)
    local = model(ids).logits
    return vocab_parallel_cross_entropy(local.flatten(0, 1), target.flatten(),
                                        sizes=head.shard.sizes, group=head.shard.group)


def _dense_step(dense, ids):
    target = ids.roll(-1, 1)
    F.cross_entropy(dense(ids).logits.flatten(0, 1), target.flatten()).backward()


def _replicas(inner, value=lambda p: p.detach()):
    """Every parameter no tensorpar layer shards, by name (to compare across ranks)."""
    sharded = {f"{n}.{leaf}" for n, m in inner.named_modules()
               for leaf in getattr(m, "sharded_dims", {})}
    return {n: value(p).clone() for n, p in inner.named_parameters() if n not in sharded}


def _tp_runs(norm_types, as_list):
    return [_tp_run(norm_type, as_list) for norm_type in norm_types]


def _tp_run(norm_type, as_list):
    dense = build()
    parallel = tp.parallelize(build(), plan_from_transformers(build()))
    head = parallel.get_output_embeddings()
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    max_norm = max_norm_for(norm_type)
    norms = []
    for step in range(STEPS):
        ids = tokens(step)
        _dense_step(dense, ids)
        _loss(parallel, ids, head).backward()
        expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm, norm_type)
        got = tp.nn.clip_grad_norm_(list(parallel.parameters()) if as_list else parallel,
                                    max_norm, norm_type)
        assert float(expected) > max_norm, (norm_type, float(expected))  # clipping is active
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        norms.append(got)
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p, dense_slice(parallel, name, dense_params[name]),
                                   rtol=TOL, atol=TOL, msg=f"{name} after {STEPS} steps")
    assert parallel.get_output_embeddings().weight is parallel.get_input_embeddings().weight
    return norms, _replicas(parallel)


def _assert_same_across_ranks(results):
    norms0, replicas0 = results[0]
    for norms, replicas in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(norms, norms0, strict=True))
        assert replicas.keys() == replicas0.keys() and replicas0
        for name, value in replicas.items():
            assert torch.equal(value, replicas0[name]), f"{name} differs across ranks"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_clip_equals_dense_torch_clip(world):
    results = run_distributed(_tp_runs, world, NORM_TYPES[world], False, timeout=300)
    for k in range(len(NORM_TYPES[world])):
        _assert_same_across_ranks([per_rank[k] for per_rank in results])


@pytest.mark.timeout(600)
def test_clip_takes_a_list_of_parameters():
    _assert_same_across_ranks(run_distributed(_tp_run, 3, 2.0, True, timeout=120))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _dense_2d(dense, opt_d, step, max_norm):
    """The dense model on both data-parallel ranks' batches at once."""
    ids = torch.cat([tokens(100 * step + r) for r in range(2)])
    _dense_step(dense, ids)
    return torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)


def _ddp_tp_run():
    mesh = _mesh()
    dp_rank = mesh.get_local_rank("dp")
    dense = build()
    inner = tp.parallelize(build(), plan_from_transformers(build()), group=mesh["tp"])
    model = tp.nn.DistributedDataParallel(inner, device_mesh=mesh["dp"])
    head = inner.get_output_embeddings()
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        expected = _dense_2d(dense, opt_d, step, 0.05)
        _loss(model, tokens(100 * step + dp_rank), head).backward()
        got = tp.nn.clip_grad_norm_(model, 0.05)
        assert float(expected) > 0.05
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        norms.append(got)
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    dense_params = dict(dense.named_parameters())
    for name, p in inner.named_parameters():
        torch.testing.assert_close(p, dense_slice(inner, name, dense_params[name]),
                                   rtol=TOL, atol=TOL, msg=f"{name} after {STEPS} steps")
    return norms, _replicas(inner)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clip_with_ddp_over_tp_on_a_2x2_mesh():
    _assert_same_across_ranks(run_distributed(_ddp_tp_run, 4, timeout=180))


def _fsdp_tp_run():
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    dp_rank = mesh.get_local_rank("dp")
    dense = build()
    model = tp.parallelize(build(), plan_from_transformers(build()), group=mesh["tp"])
    head = model.get_output_embeddings()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        expected = _dense_2d(dense, opt_d, step, 0.05)
        _loss(model, tokens(100 * step + dp_rank), head).backward()
        got = tp.nn.clip_grad_norm_(model, 0.05)
        assert float(expected) > 0.05
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        norms.append(got)
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(),
                                   dense_slice(model, name, dense_params[name]),
                                   rtol=TOL, atol=TOL, msg=f"{name} after {STEPS} steps")
    assert dist.get_world_size() == 4
    return norms, _replicas(model, lambda p: p.to_local().detach())


@pytest.mark.timeout(600)
def test_clip_with_fsdp2_over_tp_on_a_2x2_mesh():
    results = run_distributed(_fsdp_tp_run, 4, timeout=180)
    # replicas are compared between the two tensor-parallel ranks of each FSDP shard
    for dp_rank in range(2):
        _assert_same_across_ranks([results[2 * dp_rank], results[2 * dp_rank + 1]])
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[3][0], strict=True))


@pytest.mark.parametrize("norm_type", [2.0, math.inf, -math.inf, 0.0, 0.5, 1.0, 3.0])
def test_one_process_equals_torch(norm_type):
    def model_with_grads():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                    torch.nn.Linear(7, 3)).double()
        model(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
        return model

    ours, theirs = model_with_grads(), model_with_grads()
    got = tp.nn.clip_grad_norm_(ours, 0.1, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
    assert torch.equal(got, expected)
    assert torch.equal(tp.nn.grad_norm(ours, norm_type), torch.nn.utils.get_total_norm(
        [p.grad for p in theirs.parameters()], norm_type))
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def _nan_in_one_shard(norm_type):
    torch.manual_seed(0)
    layer = tp.nn.ColumnParallelLinear(4, 6, bias=False)
    layer.weight.grad = torch.ones_like(layer.weight)
    if dist.get_rank() == 1:
        layer.weight.grad[0, 0] = math.nan
    return float(tp.nn.grad_norm(layer, norm_type))


@pytest.mark.parametrize("norm_type", [math.inf, -math.inf, 2.0])
def test_a_nan_in_one_shard_gives_a_nan_norm_on_every_rank(norm_type):
    """gloo's max and min all-reduces drop a nan: the inf norm was 1.0 (torch: nan)."""
    for norm in run_distributed(_nan_in_one_shard, 2, norm_type, timeout=60):
        assert math.isnan(norm), norm


@pytest.mark.parametrize("norm_type", [2.0, math.inf, -math.inf, 0.0, -1.0])
def test_no_gradient_gives_torch_s_zero(norm_type):
    layer = torch.nn.Linear(3, 2).requires_grad_(False)
    expected = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0, norm_type)
    assert torch.equal(tp.nn.clip_grad_norm_(layer, 1.0, norm_type), expected)
    assert float(expected) == 0.0
    pipe = tp.nn.pipeline(torch.nn.Sequential(layer), microbatches=1,  # one stage
                          loss_fn=torch.nn.functional.mse_loss)
    assert float(tp.nn.clip_grad_norm_(pipe, 1.0, norm_type)) == 0.0


def test_error_if_nonfinite_raises():
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(1, 3)).sum().backward()
    layer.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        tp.nn.clip_grad_norm_(layer, 1.0, error_if_nonfinite=True)
