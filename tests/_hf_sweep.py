"""Every causal LM of the installed transformers that has a tensor-parallel plan, planned by
plan_from_transformers and compared with its dense self (tiny configs, float64).

Verdicts: ``exact`` (logits, loss and every gradient within 1e-10), ``float32-close`` (within
1e-5: the model computes parts in float32 whatever its dtype), ``refused`` (a ValueError
naming the reason, before the model changed), ``not built`` (the tiny config below does not
make a working model of that architecture: not tested), ``not run`` (too large to run),
``WRONG`` (a difference: never acceptable), ``error`` (an exception inside the forward: not
acceptable either). Each rank compares its own shards; `merge` keeps the worst rank's row.

``python -m tests._hf_sweep 2 3`` prints the table for the docs.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings

import torch
import torch.nn.functional as F

# 6 query heads of 4 over 3 key/value heads (grouped-query: uneven at TP 2); a latent
# attention gets 6 (one per head), a config that declares no num_key_value_heads or head_dim
# gets neither (`_build`)
TINY = {"vocab_size": 101, "hidden_size": 24, "intermediate_size": 50, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 4,
        "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
        "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
        "moe_intermediate_size": 10, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 10, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 8, "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        "v_head_dim": 4, "experts_implementation": "eager"}
# Per-architecture additions to TINY: fields whose defaults do not fit the tiny shapes, keep a
# large default (a per-layer-input vocabulary, a vision or audio tower), or leave a hybrid model
# with no attention layer at all in two layers (the linear-attention cache then has no length).
_ONE_ATTENTION = {"layer_types": ["linear_attention", "full_attention"]}
_DELTA_NET = {"linear_key_head_dim": 4, "linear_value_head_dim": 4,  # gated delta-net heads
              "linear_num_key_heads": 3, "linear_num_value_heads": 6}
_MAMBA2 = {"mamba_n_heads": 6, "mamba_d_state": 8, "mamba_chunk_size": 8}  # 6 divides 2 * 24
_INKLING = {"swa_num_attention_heads": 6, "swa_num_key_value_heads": 3, "swa_head_dim": 4,
            "d_rel": 4, "rel_extent": 16, "sliding_window_size": 4,  # sliding layers' heads
            "layer_types": ["hybrid_sliding", "hybrid"]}  # one sliding, one full layer
_INKLING2 = {**_INKLING, "unpadded_vocab_size": 101, "n_layers_per_attn_res_block": 1}
OVERRIDES: dict[str, dict[str, object]] = {
    "bailing_hybrid": {"layer_group_size": 2},  # every second layer full attention
    "bamba": {**_MAMBA2, "attn_layer_indices": [1]},  # none by default
    "cohere_compass_text": {  # rope parameters per layer type, none by default
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "diffllama": {"num_key_value_heads": 2},  # its differential attention needs an even count
    "dots1": {"n_shared_experts": 1},  # None by default, which the MoE block multiplies by
    "dots3_note_text": {"shared_experts_intermediate_size": 10,  # and its indexer's heads
                        "index_head_dim": 4, "index_n_heads": 2, "index_topk": 4,
                        # its sliding layers' latent attention (64 heads of 256 by default)
                        "swa_num_attention_heads": 6, "swa_num_key_value_heads": 6,
                        "swa_q_lora_rank": 12, "swa_kv_lora_rank": 8, "swa_head_dim": 8,
                        "swa_qk_nope_head_dim": 4, "swa_v_head_dim": 4},
    "falcon_h1": {"mamba_d_ssm": 48, "mamba_n_heads": 6, "mamba_d_head": 8,  # 128 heads of 8
                  "mamba_d_state": 8, "mamba_chunk_size": 8},  # and a state of 256 by default
    "gemma3n_text": {"vocab_size_per_layer_input": 101, "hidden_size_per_layer_input": 4,
                     "laurel_rank": 4, "num_kv_shared_layers": 0,  # 15 by default
                     "activation_sparsity_pattern": [0.95, 0.0],  # its checkpoints': 10 of 35
                     "layer_types": ["sliding_attention", "full_attention"]},
    "gemma4_text": {"vocab_size_per_layer_input": 101, "hidden_size_per_layer_input": 4,
                    "global_head_dim": 8,  # the full-attention layers' head size (512)
                    "layer_types": ["sliding_attention", "full_attention"]},
    "gptj": {"rotary_dim": 2},  # 64 by default, wider than the heads
    "granitemoehybrid": {**_MAMBA2, "layer_types": ["mamba", "attention"],  # all mamba
                         "shared_intermediate_size": 10},  # 1024 by default
    "inkling_text": {**_INKLING, "n_shared_experts": 1},  # 2 by default
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": {**_INKLING2, "loop_layer_index_start": 1, "loop_layer_index_end": 2,
                           "loop_num_passes": 2, "loop_gate_rank": 4},  # layer 1 runs twice
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # every 8th from the 5th
    "kimi_linear": {**_ONE_ATTENTION, "linear_head_dim": 4, "linear_num_heads": 6},  # 32 of 128
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None by default
    "lfm3": {"layer_types": ["conv", "full_attention"]},  # two conv layers by default
    "llama4": {"text_config": {}},  # the causal LM is built on the text config (below)
    "phi4_multimodal": {  # the vision and audio towers
        "vision_config": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "crop_size": 28,
                          "patch_size": 14},
        "audio_config": {"hidden_size": 8, "intermediate_size": 16, "num_blocks": 1,
                         "num_attention_heads": 2, "ext_pw_out_channel": 8,
                         "depthwise_separable_out_channel": 8, "nemo_conv_channels": 8}},
    "qwen3_5_moe_text": {**_ONE_ATTENTION, **_DELTA_NET},
    "qwen3_5_text": {**_ONE_ATTENTION, **_DELTA_NET},
    "qwen3_next": {**_ONE_ATTENTION, **_DELTA_NET},
    "qwen4_exp_text": {**_DELTA_NET, "layer_types": ["linear_attention", "indexed_attention"],
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 4,
                       "indexer_budget": 4, "indexer_compress_ratio": 2,  # none by default
                       "hc_lowrank": 4},  # 320 by default
}
# transformers runs some of these models' modules in float32 by design (their
# ``_keep_in_fp32_modules_strict``, inputs cast to float32 in the code): model.double() would
# break them, so they stay float32 as transformers loads them
KEEP_FLOAT32 = {"inkling2_text", "inkling2_loop_text"}
# tiny configs that still build models of hundreds of millions of parameters: not run, to keep
# the sweep's memory small
TOO_LARGE: set[str] = set()


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


def _build(model_type: str, config_name: str, cls: str,  # type: ignore[no-untyped-def]
           layers: int = 2, extra: dict[str, object] | None = None):
    """The tiny model; ``extra``: more fields, each set where the config declares it."""
    import transformers

    fields = {**TINY, **OVERRIDES.get(model_type, {}), "num_hidden_layers": layers}
    for name, value in list(fields.items()):  # a pattern per layer, repeated to the count
        if name in ("layer_types", "activation_sparsity_pattern") and isinstance(value, list):
            fields[name] = [value[i % len(value)] for i in range(layers)]
    if "text_config" in fields:  # a composite config whose text part makes the causal LM
        fields = {"text_config": {**TINY, **fields["text_config"], **(extra or {})}}
    config_cls = getattr(transformers, config_name)
    declared = {f.name for f in dataclasses.fields(config_cls)} | set(config_cls.attribute_map)
    if "num_layers" in declared and layers != TINY["num_hidden_layers"]:
        fields.pop("num_hidden_layers")  # longcat_flash: two "hidden layers" per layer
        fields["num_layers"] = layers
    if "kv_lora_rank" in declared:
        fields["num_key_value_heads"] = 6  # latent attention: one key/value per head
    for name in ("num_key_value_heads", "head_dim"):  # a config without them has no such
        if name not in declared:  # attribute, which the planner would otherwise read
            fields.pop(name, None)
    fields.update({name: value for name, value in (extra or {}).items() if name in declared})
    config = config_cls(**fields)
    model_cls = getattr(transformers, cls)
    if not isinstance(config, model_cls.config_class):  # as AutoModelForCausalLM does
        config = config.get_text_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).double().eval()  # no dropout: deterministic
    if model_type in KEEP_FLOAT32:
        keep = model._keep_in_fp32_modules_strict
        for owner, module in model.named_modules():
            for kind in (module._parameters, module._buffers):
                for leaf, t in kind.items():
                    if t is not None and any(k in f"{owner}.{leaf}" for k in keep):
                        t.data = t.data.float()
    return model


def check(model_type: str, config_name: str, cls: str) -> tuple[str, str]:
    """The verdict for one architecture on this rank (every rank gets the same)."""
    import tensorpar as tp
    from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy

    if model_type in TOO_LARGE:
        return "not run", "the tiny config still builds a large model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dense = _build(model_type, config_name, cls)
            parallel = _build(model_type, config_name, cls)
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


def merge(results: list[list[tuple[str, str, str]]]) -> list[tuple[str, str, str]]:
    """One row per architecture from every rank's rows.

    Each rank compares its own shards, so the differences differ between ranks: the row is
    the worst rank's (exact < float32-close < WRONG; the largest difference). Any other
    verdict must be the same on every rank, or the row is an error.
    """
    order = {"exact": 0, "float32-close": 1, "WRONG": 2}
    rows = []
    for same in zip(*results, strict=True):
        verdicts = {verdict for _, verdict, _ in same}
        if verdicts <= order.keys():
            rows.append(max(same, key=lambda r: (order[r[1]], _size(r[2]))))
        elif len(verdicts) == 1:
            rows.append(same[0])
        else:
            rows.append((same[0][0], "error", "the ranks disagree: " + " / ".join(
                f"{verdict} ({reason})" for _, verdict, reason in same)))
    return rows


def _size(reason: str) -> float:  # "largest difference 1.2e-09 (...)", "... differs by 3e-02"
    found = re.search(r"(?:difference|differs by) ([0-9.]+e[-+][0-9]+)", reason)
    return float(found.group(1)) if found else 0.0


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) < 300 else text[:297] + "..."


def main(sizes: list[int]) -> None:
    from tensorpar.testing import run_distributed

    results = {n: merge(run_distributed(sweep, n, timeout=3000)) for n in sizes}
    print("| architecture | " + " | ".join(f"TP {n}" for n in sizes) + " | reason |")
    print("|---|" + "---|" * len(sizes) + "---|")
    for i, (model_type, _, _) in enumerate(results[sizes[0]]):
        verdicts = [results[n][i][1] for n in sizes]
        reason = next((results[n][i][2] for n in sizes if results[n][i][2]), "")
        print(f"| {model_type} | " + " | ".join(verdicts) + f" | {reason.replace('|', '/')} |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 3])
