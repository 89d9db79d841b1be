"""Context parallelism's saved activations per rank scale with T / W.

The bytes autograd saves during the forward are counted with ``saved_tensors_hooks`` (each
storage once, parameters left out: they are replicated, not activations). A one-layer Llama
at T = 1024 must save at most 1/W of the dense model's bytes plus 10% on every rank: no rank
keeps the whole key/value sequence (or any (T, T) matrix) for the backward.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.nn import context_parallel
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

TOTAL = 1024


def build():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=8,
                                      num_key_value_heads=8, head_dim=32,
                                      max_position_embeddings=TOTAL)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def saved_bytes(model, ids):
    """Bytes of the activations autograd saves in one forward (each storage counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    out.loss.backward()  # the saved tensors were usable
    return sum(seen.values())


def _measure():
    ids = torch.randint(0, 64, (1, TOTAL), generator=torch.Generator().manual_seed(0))
    dense = saved_bytes(build(), ids)
    return dense, saved_bytes(context_parallel(build()), ids), dist.get_world_size()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_saved_activations_scale_with_length_over_ranks(world):
    for rank, (dense, mine, size) in enumerate(run_distributed(_measure, world, timeout=600)):
        assert mine <= dense / size * 1.1, (
            f"rank {rank}: saves {mine} bytes, dense {dense}: {mine / dense:.3f} of dense, "
            f"expected <= {1.1 / size:.3f}")
