"""Every causal LM of the installed transformers that has a tensor-parallel plan, planned by
plan_from_transformers and compared with its dense self (tiny configs, float64).

Verdicts: ``exact`` (logits, loss and every gradient within 1e-10), ``float32-close`` (within
1e-5: the model computes parts in float32 whatever its dtype), ``refused`` (a ValueError
naming the reason, before the model changed), ``not built`` (the tiny config below does not
make a working model of that architecture: not tested), ``WRONG`` (a difference: never acceptable),
``error`` (an exception inside the forward: not acceptable either).

``python -m tests._hf_sweep 2 3`` prints the table for the docs.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F

TINY = {"vocab_size": 101, "hidden_size": 24, "intermediate_size": 50, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 4,
        "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
        "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
        "moe_intermediate_size": 10, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 10, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 8, "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        "v_head_dim": 4, "experts_implementation": "eager"}
# tiny configs that still build models of hundreds of millions of parameters (vision or
# audio towers, per-layer embeddings): not run, to keep the sweep's memory small
TOO_LARGE = {"phi4_multimodal", "gemma4_text", "inkling_text", "inkling2_text",
             "inkling2_loop_text"}


def architectures() -> list[tuple[str, str, str]]:
    """``(model_type, config class, causal LM class)`` for every causal LM with a plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        config_name = CONFIG_MAPPING_NAMES.get(model_type)
        config_cls = getattr(transformers, config_name, None) if config_name else None
        if config_cls is not None and getattr(config_cls, "base_model_tp_plan", None) \
                and isinstance(cls, str) and hasattr(transformers, cls):
            out.append((model_type, config_name, cls))
    return out


def _build(config_name: str, cls: str):  # type: ignore[no-untyped-def]
    import transformers

    config = getattr(transformers, config_name)(**TINY)
    if getattr(config, "kv_lora_rank", None):  # latent attention: one key/value per head
        config = getattr(transformers, config_name)(**{**TINY, "num_key_value_heads": 6})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).double().eval()  # no dropout: deterministic


def check(model_type: str, config_name: str, cls: str) -> tuple[str, str]:
    """The verdict for one architecture on this rank (every rank gets the same)."""
    import tensorpar as tp
    from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy

    if model_type in TOO_LARGE:
        return "not run", "the tiny config still builds a large model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dense, parallel = _build(config_name, cls), _build(config_name, cls)
        except Exception as e:
            return "not built", f"{type(e).__name__}: {_line(e)}"
        try:
            plan = plan_from_transformers(dense)
        except ValueError as e:
            return "refused", _line(e)
        except Exception as e:
            return "error", f"planning: {type(e).__name__}: {_line(e)}"
        try:
            tp.parallelize(parallel, plan)
        except ValueError as e:
            return "refused", _line(e)
    ids = torch.randint(2, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    target = ids.roll(-1, 1).flatten()
    try:
        dense_logits = dense(ids).logits
    except Exception as e:
        return "not built", f"the dense model fails: {type(e).__name__}: {_line(e)}"
    try:
        head = parallel.get_output_embeddings()
        logits = parallel(ids).logits
        shard = getattr(head, "shard", None)
        if shard is not None and not getattr(head, "gather_output", True):
            dense_local = dense_logits[..., shard.start: shard.stop]
            loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target, sizes=shard.sizes)
        else:
            dense_local = dense_logits
            loss = F.cross_entropy(logits.flatten(0, 1), target)
        dense_loss = F.cross_entropy(dense_logits.flatten(0, 1), target)
        errors = {"logits": (logits - dense_local).abs().max().item(),
                  "loss": (loss - dense_loss).abs().item()}
        dense_loss.backward()
        loss.backward()
        grads = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            owner, _, leaf = name.rpartition(".")
            module = parallel.get_submodule(owner)
            dim = getattr(module, "sharded_dims", {}).get(leaf)
            expected = grads[name].grad
            if dim is not None and expected is not None:
                expected = torch.cat([expected.narrow(dim, s, n) for s, _, n in
                                      module.shard.pieces], dim)
            if (p.grad is None) != (expected is None):
                return "WRONG", f"{name}: a gradient on one side only"
            if p.grad is not None:
                errors[name] = (p.grad - expected).abs().max().item()
    except Exception as e:
        return "error", f"{type(e).__name__}: {_line(e)}"
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] <= 1e-10:
        return "exact", ""
    if errors[worst] <= 1e-5:
        return "float32-close", f"largest difference {errors[worst]:.1e} ({worst})"
    return "WRONG", f"{worst} differs by {errors[worst]:.2e}"


def sweep(names: list[str] | None = None) -> list[tuple[str, str, str]]:
    """``(model_type, verdict, reason)`` for every architecture (or those named)."""
    rows = []
    for model_type, config_name, cls in architectures():
        if names is None or model_type in names:
            rows.append((model_type, *check(model_type, config_name, cls)))
    return rows


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) < 300 else text[:297] + "..."


def main(sizes: list[int]) -> None:
    from tensorpar.testing import run_distributed

    results = {n: run_distributed(sweep, n, timeout=3000)[0] for n in sizes}
    print("| architecture | " + " | ".join(f"TP {n}" for n in sizes) + " | reason |")
    print("|---|" + "---|" * len(sizes) + "---|")
    for i, (model_type, _, _) in enumerate(results[sizes[0]]):
        verdicts = [results[n][i][1] for n in sizes]
        reason = next((results[n][i][2] for n in sizes if results[n][i][2]), "")
        print(f"| {model_type} | " + " | ".join(verdicts) + f" | {reason.replace('|', '/')} |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 3])
