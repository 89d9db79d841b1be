"""context_parallel across transformers' families, and the pieces some of them need.

A family's attention may carry more than the ring's causal mask and window (gpt-oss's
attention sinks), and some families mix positions outside attention (a mamba or
linear-attention layer, a per-layer input computed from the token ids), which a split
sequence gets silently wrong. So context_parallel runs only the families measured equal
to dense (`CONTEXT_MODEL_TYPES`) and refuses the others by name.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.testing import run_distributed

TOL = 1e-10


def _sink_errors(lengths, causal, window):
    """Ring attention with sinks against the eager formula (sink logits beside the keys')."""
    from tensorpar.comm._group import resolve_group
    from tensorpar.context._ring import RingSpec, ring_apply
    from tensorpar.context.layout import contiguous_layout
    from tests.test_ring_attention import dense_mask

    rank = dist.get_rank() if dist.is_initialized() else 0
    total, batch, heads, dim, scale = sum(lengths), 2, 4, 5, 0.3
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, heads, total, dim, generator=g, dtype=torch.float64)
               for _ in range(3))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, total, dim, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    logits = leaves[0] @ leaves[1].transpose(-1, -2) * scale
    logits = logits.masked_fill(~dense_mask(total, causal, window), float("-inf"))
    with_sink = torch.cat([logits, leaves[3].view(1, -1, 1, 1).expand(batch, -1, total, 1)], -1)
    ref = torch.softmax(with_sink, -1)[..., :-1] @ leaves[2]
    ref.backward(dout)
    start = sum(lengths[:rank])
    mine = slice(start, start + lengths[rank])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    spec = RingSpec(group=resolve_group(None, "test"), layout=contiguous_layout(list(lengths)),
                    causal=causal, window=window, scale=scale, kv_groups=1)
    out = ring_apply(*local, spec, local_sinks)
    out.backward(dout[:, :, mine])
    if dist.is_initialized():  # each rank's queries' share of the sinks' gradient
        dist.all_reduce(local_sinks.grad)
    errors = {"out": (out - ref[:, :, mine]).abs().max().item() if out.numel() else 0.0,
              "dsinks": (local_sinks.grad - leaves[3].grad).abs().max().item()}
    for name, loc, full in zip("qkv", local, leaves, strict=False):
        diff = loc.grad - full.grad[:, :, mine]
        errors["d" + name] = diff.abs().max().item() if diff.numel() else 0.0
    return errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lengths,causal,window", [((6, 9), True, None), ((5, 0, 8), True, 4),
                                                   ((7, 3), False, None)])
def test_ring_attention_with_sinks(lengths, causal, window):
    for rank, errors in enumerate(run_distributed(_sink_errors, len(lengths), lengths, causal,
                                                  window, timeout=120)):
        for name, err in errors.items():
            assert err < TOL, f"rank {rank}: {name} off by {err}"
