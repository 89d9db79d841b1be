"""Pipeline parallelism on a transformers Llama: loss, every gradient and AdamW steps equal dense.

transformers computes its causal-LM loss on ``logits.float()`` (float32 even in a float64
model), so the model's own loss of a microbatched batch differs from the whole batch's by
float32 rounding (~1e-7). The float64 checks therefore pass the same causal-LM loss computed
in float64 (`lm_loss`) to both sides; the model's own loss (``loss_fn=None``) is checked
at float32 tolerance, with ignored (-100) labels to check the token-count weighting.
"""

import pytest
import torch
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

TOL = 1e-10
VOCAB = 101


# a sliding window of 4 tokens, shorter than the sequences: a wrong mask changes the loss
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    # sliding attention from layer 2 on (layer_types), full before
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
}


def llama(layers=4, dtype=torch.float64, tied=False, family="llama"):
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=50, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=3, head_dim=4, max_position_embeddings=64,
        tie_word_embeddings=tied, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype)


def lm_loss(logits, labels):
    """The causal-LM loss (next-token cross entropy, mean over label tokens) in float64."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1), ignore_index=-100)


def tokens(step, batch=6, length=9):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _llama_matches_dense(schedule, virtual, microbatches, lengths, own_loss, tied=False,
                         family="llama"):
    dense = llama(tied=tied, family=family)
    pipe = tp.nn.pipeline(llama(tied=tied, family=family), microbatches=microbatches,
                          schedule=schedule,
                          virtual_stages=virtual, loss_fn=None if own_loss else lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=0.01)
    tol = 1e-6 if own_loss else TOL
    for step, length in enumerate(lengths):  # a new sequence length per step: no rebuild
        ids = tokens(step, length=length)
        labels = ids.clone()
        if own_loss:
            labels[0, 3:] = -100  # rows with fewer label tokens: weights by token counts
        loss = pipe.step(ids if pipe.is_first else None, labels if pipe.is_last else None)
        out = dense(ids, labels=labels) if own_loss else None
        dense_loss = out.loss if out is not None else lm_loss(dense(ids).logits, labels)
        dense_loss.backward()
        if pipe.is_last:
            torch.testing.assert_close(loss, dense_loss.detach().to(loss.dtype), rtol=tol,
                                       atol=tol)
        grads = dict(dense.named_parameters())
        grads["lm_head.weight"] = dense.lm_head.weight  # tied: one parameter, two names
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=tol, atol=tol,
                                       msg=f"step {step}: {name}")
        # the norm over the pipeline counts a tied embedding once, like dense
        torch.testing.assert_close(tp.nn.grad_norm(pipe), torch.nn.utils.get_total_norm(
            [p.grad for p in dense.parameters()]), rtol=tol, atol=tol)
        opt.step(), dense_opt.step(), opt.zero_grad(), dense_opt.zero_grad()
    params = dict(dense.named_parameters())
    params["lm_head.weight"] = dense.lm_head.weight
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=tol, atol=tol, msg=name)
    return sorted(name for name, _ in pipe.named_parameters())


def _names(family="llama"):
    return {name for name, _ in llama(family=family).named_parameters()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2),
                                              ("zero-bubble", 1), ("zero-bubble", 2)])
def test_llama_equals_dense(schedule, virtual, world_size):
    if virtual * world_size > 4:
        pytest.skip("4 decoder layers fill at most 4 stages")
    results = run_distributed(_llama_matches_dense, world_size, schedule, virtual, 4, (9, 6),
                              False, timeout=150)
    held = [n for r in results for n in r]
    assert sorted(held) == sorted(_names())  # every parameter on exactly one rank
    assert "model.embed_tokens.weight" in results[0]
    assert "lm_head.weight" in results[(world_size * virtual - 1) % world_size]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_own_loss_weights_by_label_tokens(world_size):
    run_distributed(_llama_matches_dense, world_size, "1f1b", 1, 3, (7,), True, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size,schedule", [(2, "1f1b"), (3, "1f1b"), (2, "zero-bubble")])
def test_llama_tied_embedding_sums_both_stages_gradients(world_size, schedule):
    results = run_distributed(_llama_matches_dense, world_size, schedule, 1, 3, (9,), False,
                              True, timeout=150)
    assert "model.embed_tokens.weight" in results[0] and "lm_head.weight" in results[-1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_llama_family_with_sliding_windows_equals_dense(family):
    # 4 layers on 2 ranks x 2 virtual stages, sequences of 9 then 6 tokens past the window
    results = run_distributed(_llama_matches_dense, 2, "1f1b", 2, 4, (9, 6), False, False,
                              family, timeout=150)
    assert sorted(n for r in results for n in r) == sorted(_names(family))


def test_llama_single_process_pipeline_equals_dense():
    # one process, 2 virtual stages: no communication, the schedule and the loss weighting
    names = _llama_matches_dense("1f1b", 2, 3, (9, 5), False)
    assert names == sorted(_names())
