"""transformers mixture-of-experts models, experts spread over the ranks, equal dense."""

import warnings

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.nn import ParallelExperts, plan_from_transformers
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

VOCAB = 61
COMMON = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
          "max_position_embeddings": 32, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_experts_per_tok": 2, "experts_implementation": "eager",
          "attn_implementation": "eager"}
# 8 experts: 4/4, 3/3/2 and 2/2/2/2 per rank
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"intermediate_size": 12, "num_local_experts": 8, "head_dim": 4,
                 "router_aux_loss_coef": 0.1}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"intermediate_size": 20, "moe_intermediate_size": 12, "num_experts": 8,
                   "shared_expert_intermediate_size": 14, "router_aux_loss_coef": 0.1,
                   "norm_topk_prob": True}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"intermediate_size": 20, "moe_intermediate_size": 12, "num_experts": 8,
                   "head_dim": 4, "router_aux_loss_coef": 0.1}),
    # (the gathered q/k/v projections split on head boundaries at 2, 3 and 4 ranks only
    # with equal head counts: 12 heads of 2 in 24 features)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {"intermediate_size": 12, "num_experts": 8, "router_aux_loss_coef": 0.1,
               "hidden_size": 24, "num_attention_heads": 12, "num_key_value_heads": 12}),
    # grouped routing (2 groups, 1 chosen), a shared expert, a dense first layer
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"intermediate_size": 20, "moe_intermediate_size": 12,
                     "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8,
                     "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                     "v_head_dim": 4, "num_key_value_heads": 8, "num_mtp_layers": 0}),
}
HAS_AUX = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}


def build(arch, dtype=torch.float64):
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype)
    with torch.no_grad():  # the router starts at zeros in some models: make routing uneven
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "experts" in name:
                p.normal_(0.0, 0.5)
    return model


def plan_for(arch, model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "left replicated" warning
        return plan_from_transformers(model, lm_head="gathered", experts="expert_parallel")


def local_part(model, name, dense_tensor):
    """The slice of a dense tensor the parallel model's parameter ``name`` holds."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    dim = getattr(module, "sharded_dims", {}).get(leaf)
    if dim is None or not hasattr(module, "shard"):
        return dense_tensor
    return torch.cat([dense_tensor.narrow(dim, start, n) for start, _, n in module.shard.pieces],
                     dim)


def _loss(arch, model, ids):
    kwargs = {"output_router_logits": True} if arch in HAS_AUX else {}
    out = model(ids, labels=ids, **kwargs)
    if arch in HAS_AUX:
        assert out.aux_loss is not None and out.aux_loss.item() > 0
    return out.logits, out.loss


def _model_vs_dense(arch, tol):
    rank = dist.get_rank()
    dense = build(arch)
    parallel = tp.parallelize(build(arch), plan_for(arch, build(arch)))
    layers = [m for m in parallel.modules() if isinstance(m, ParallelExperts)]
    assert layers, "no experts were split"
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-2, weight_decay=0.1)
    close = {"rtol": tol, "atol": tol}
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(step))
        dense_logits, dense_loss = _loss(arch, dense, ids)
        with tp.CommCounter() as counter:
            logits, loss = _loss(arch, parallel, ids)
        # per MoE layer (tokens replicated over the tensor-parallel group): no dispatch, one
        # all-to-all that sends each rank's sums to every peer (and no other all-to-all)
        assert counter.count("all_to_all") == len(layers), counter
        torch.testing.assert_close(logits, dense_logits, **close)
        torch.testing.assert_close(loss, dense_loss, **close)
        dense_loss.backward()
        loss.backward()
        dense_params = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            expected = local_part(parallel, name, dense_params[name].grad)
            torch.testing.assert_close(p.grad, expected, **close, msg=f"{name} step {step}")
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p, local_part(parallel, name, dense_params[name]), **close,
                                   msg=f"{name} after 3 AdamW steps")
    # this rank holds only its experts
    mine = sum(p.numel() for m in layers for p in m.parameters())
    per_expert = sum(p[0].numel() for p in layers[0].parameters())
    assert mine == len(layers) * layers[0].shard.sizes[rank] * per_expert
    dense_experts = sum(p.numel() for n, p in dense.named_parameters() if ".experts." in n)
    return mine, dense_experts


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_moe_model_equals_dense(arch, world):
    results = run_distributed(_model_vs_dense, world, arch, 1e-10, timeout=180)
    mine = [m for m, _ in results]
    assert sum(mine) == results[0][1]  # the ranks' experts add up to the dense model's
    assert max(mine) < results[0][1]


def _save(arch, path):
    import torch.distributed.checkpoint as dcp

    model = tp.parallelize(build(arch), plan_for(arch, build(arch)))
    dense = build(arch)
    with torch.no_grad():  # every dense parameter moved by a seeded step, then sharded
        for i, p in enumerate(dense.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i),
                               dtype=p.dtype))
        params = dict(model.named_parameters())
        for name, p in dense.named_parameters():
            params[name].copy_(local_part(model, name, p))
    dcp.save(tp.sharded_state_dict(model), checkpoint_id=path)
    full = tp.full_state_dict(model)
    expected = dense.state_dict()
    if dist.get_rank() == 0:  # full_state_dict gives the dense layout, experts stacked
        for key, value in expected.items():
            assert torch.equal(full[key], value), key
    return {k: v.clone() for k, v in expected.items()}


def _load(arch, path):
    import torch.distributed.checkpoint as dcp

    model = tp.parallelize(build(arch), plan_for(arch, build(arch)))
    state = tp.sharded_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state)
    full = tp.full_state_dict(model)
    return {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None


def _load_dense(arch, path):
    import torch.distributed.checkpoint as dcp

    model = build(arch)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("save_world, load_world", [(2, 3), (3, 4)])
def test_checkpoint_loads_at_another_expert_parallel_size(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, save_world, "qwen2_moe", path, timeout=240)[0]
    loaded = run_distributed(_load, load_world, "qwen2_moe", path, timeout=240)[0]
    dense = run_distributed(_load_dense, 1, "qwen2_moe", path, timeout=240)[0]
    assert saved.keys() == loaded.keys() == dense.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
        assert torch.equal(saved[key], dense[key]), key


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(arch, model, opt, steps):
    for step in steps:
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(step))
        _loss(arch, model, ids)[1].backward()
        opt.step()
        opt.zero_grad()


def _save_optimizer(arch, path):
    import torch.distributed.checkpoint as dcp

    model = tp.parallelize(build(arch), plan_for(arch, build(arch)))
    opt = _adamw(model)
    _train(arch, model, opt, range(2))
    dcp.save({"model": tp.sharded_state_dict(model),
              "optim": tp.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _resume_optimizer(arch, path, parallel):
    """A fresh model and AdamW (other weights) load the checkpoint and step once more."""
    import torch.distributed.checkpoint as dcp

    model = tp.parallelize(build(arch), plan_for(arch, build(arch))) if parallel else build(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing of the fresh model may survive the load
    opt = _adamw(model)
    state = {"model": tp.sharded_state_dict(model),
             "optim": tp.sharded_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state["model"])
    tp.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    _train(arch, model, opt, range(2, 3))
    dense = build(arch)  # the uninterrupted run: three steps
    dense_opt = _adamw(dense)
    _train(arch, dense, dense_opt, range(3))
    close = {"rtol": 1e-10, "atol": 1e-10}
    expected = dict(dense.named_parameters())
    experts = 0
    for name, p in model.named_parameters():
        ref = expected[name]
        torch.testing.assert_close(p, local_part(model, name, ref), **close, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key],
                                       local_part(model, name, dense_opt.state[ref][key]),
                                       **close, msg=f"{name} {key}")
        assert int(opt.state[p]["step"]) == 3
        experts += p.numel() if ".experts." in name else 0
    return experts


def test_optimizer_state_saved_at_ep2_resumes_at_ep2_ep3_and_dense(tmp_path):
    # AdamW after 2 steps at 2 ranks (experts 4/4), saved with DCP; a fresh model loads it
    # at 2 and 3 ranks (experts 3/3/2) and dense, steps once more: equal to 3 dense steps
    path = str(tmp_path / "ckpt")
    run_distributed(_save_optimizer, 2, "qwen2_moe", path, timeout=240)
    dense_experts = run_distributed(_resume_optimizer, 1, "qwen2_moe", path, False,
                                    timeout=240)[0]
    for world in (2, 3):
        held = run_distributed(_resume_optimizer, world, "qwen2_moe", path, True, timeout=240)
        assert sum(held) == dense_experts and max(held) < dense_experts


def _few_experts(k):
    """3 experts on 4 ranks (the last holds none), top-``k`` routing, clipped AdamW steps,
    batches down to one token (a rank's experts then see one row, or none)."""
    import transformers

    config = transformers.MixtralConfig(**{**COMMON, **ARCHS["mixtral"][2],
                                           "num_local_experts": 3, "num_experts_per_tok": k})

    def build_few():
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config).double()

    dense, parallel = build_few(), build_few()
    tp.parallelize(parallel, plan_for("mixtral", parallel))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, parallel)]
    dense_params = dict(dense.named_parameters())
    worst = 0.0
    for step, shape in enumerate([(2, 7), (1, 1), (1, 2)]):
        ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(step))
        dense(ids, labels=ids).loss.backward()
        parallel(ids, labels=ids).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
        got = tp.nn.clip_grad_norm_(parallel, 0.05)
        worst = max(worst, abs(float(got - want)))
        for name, p in parallel.named_parameters():
            if p.grad is not None or p.numel():
                expected = local_part(parallel, name, dense_params[name].grad)
                worst = max(worst, float((p.grad - expected).abs().max()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return worst


@pytest.mark.parametrize("k", [1, 3])
def test_fewer_experts_than_ranks_clipped_and_one_token_batches_equal_dense(k):
    assert max(run_distributed(_few_experts, 4, k, timeout=180)) < 1e-10
