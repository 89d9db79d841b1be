"""Context parallelism: ring attention against its limit, one layer and a 2-layer Llama.

Per rank, forward+backward, float32, causal, the zigzag layout. Every case runs once per
round, in the same rounds (`time_side_by_side`, one round at a time); each ratio is the
median over rounds of the ratio within a round:

- ``ring``: `ring_attention`'s Function on the rank's rows (the layer), or the model under
  `context_parallel` (the Llama).
- ``compute``: this rank's share of the arithmetic, locally, no ring: each query segment
  against the keys before it (SDPA, no mask: all of them are seen) and against its own
  positions (SDPA with ``is_causal``: the kernel skips the masked half, as the ring's
  diagonal blocks do); the pieces are summed, not merged (a merge is not part of the
  least work). The Llama's is the same model step with this attention (its loss and
  gradient all-reduces included, as in the ring's).
- ``comm``: the ring's transfers alone: ``W - 1`` key/value chunk hops forward, then
  ``W - 1`` chunk hops beside ``W`` gradient hops backward, per attention (the rank's
  longest chunk).
- ``limit``: ``max(compute, comm)`` of the same round, since the ring overlaps its
  transfers with its arithmetic; ``ring/limit`` is the paired ratio to it.
- ``packed attention layer``: the same layer over a row packed with documents of
  ``PACKED_DOCUMENT`` tokens (ring attention's ``documents``); its compute takes each
  query piece against its own document's keys only (what a variable-length kernel does).
- ``padded attention layer``: the same layer over a row whose first quarter is left
  padding (ring attention's ``key_mask``); its compute takes only the kept queries
  against the kept keys they see (a padded query's output is zero).
- ``ulysses`` (the Llama): the same model under ``context_parallel(attention="ulysses")``.
- saved activations per rank (``saved_tensors_hooks``), against the dense layer or model.

torch's experimental ``context_parallel`` is not timed: this suite runs on CPU with gloo,
where its SDPA has no sharding strategy; `torch_cp_note` reports what it raises here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar.bench.workloads._timing import time_side_by_side
from tensorpar.comm._group import resolve_group
from tensorpar.context._blocks import Documents, Padding, Visible
from tensorpar.context._ring import RingSpec, _Transfer, ring_apply
from tensorpar.context.hf import CALL
from tensorpar.context.layout import Layout, positions, zigzag_layout

__all__ = ["LAYER", "LLAMA", "run_rank", "torch_cp_note"]

LAYER: dict[str, int] = {"batch": 1, "heads": 4, "head_dim": 32}
LLAMA: dict[str, Any] = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "head_dim": 32}
_IDEAL = "tensorpar_bench_ideal"
PACKED_DOCUMENT = 700
"""Tokens per document of the packed case (not a divisor of the chunk lengths: documents
cross the chunk cuts)."""


def _saved_bytes(fn: Any, exclude: set[int]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


Span = tuple[int, int, int, int]
"""``(at, start, length, first)``: local query rows ``at:at + length`` at global positions
``start:start + length``, seeing the keys from ``first`` up to themselves."""


def _attend(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
            spans: list[Span]) -> torch.Tensor:
    """The arithmetic of each span's attention, locally; rows in no span get zeros.

    A span's queries against the keys before it (no mask: every one is seen) plus against
    its own positions (``is_causal``: the kernel skips the masked half). The two outputs
    are summed: the cost of the arithmetic, not the attention's values.
    """
    outs, done = [], 0
    for at, start, length, first in spans:
        if at > done:
            outs.append(q.new_zeros((*q.shape[:2], at - done, v_full.shape[-1])))
        qs = q[:, :, at: at + length]
        end = start + length
        out = F.scaled_dot_product_attention(qs, k_full[:, :, start:end], v_full[:, :, start:end],
                                             is_causal=True)
        if first < start:
            out = out + F.scaled_dot_product_attention(qs, k_full[:, :, first:start],
                                                       v_full[:, :, first:start])
        outs.append(out)
        done = at + length
    if done < q.shape[2]:
        outs.append(q.new_zeros((*q.shape[:2], q.shape[2] - done, v_full.shape[-1])))
    return torch.cat(outs, dim=2)


def _spans(layout: Layout, rank: int) -> list[Span]:
    """Each query segment of the rank against the key prefix it sees."""
    spans, at = [], 0
    for seg in layout[rank]:
        spans.append((at, seg.start, seg.length, 0))
        at += seg.length
    return spans


def _packed_spans(layout: Layout, rank: int, document: int) -> list[Span]:
    """Each query segment cut at the document ends, each piece against its own document."""
    spans, at = [], 0
    for seg in layout[rank]:
        start = seg.start
        while start < seg.start + seg.length:
            first = start - start % document  # its document's first position
            end = min(seg.start + seg.length, first + document)
            spans.append((at, start, end - start, first))
            at += end - start
            start = end
    return spans


def _padded_spans(layout: Layout, rank: int, first: int) -> list[Span]:
    """The kept queries (from ``first`` on) against the kept keys they see."""
    spans, at = [], 0
    for seg in layout[rank]:
        padded = min(max(first - seg.start, 0), seg.length)
        if padded < seg.length:
            spans.append((at + padded, seg.start + padded, seg.length - padded, first))
        at += seg.length
    return spans


def _comm(spec: RingSpec, chunk: torch.Tensor, attentions: int) -> Callable[[], None]:
    """The ring's transfers for ``attentions`` attentions' forward+backward, nothing else."""
    size = spec.group.size
    kv_in, grad_in = torch.empty_like(chunk), torch.empty_like(chunk)

    def run() -> None:
        for _ in range(attentions):
            for _ in range(size - 1):  # forward: the key/value chunks
                _Transfer(spec, chunk, kv_in, 0x52AF).wait()
            for step in range(size):  # backward: the chunks again, the gradients beside them
                kv = _Transfer(spec, chunk, kv_in, 0x52AF) if step < size - 1 else None
                _Transfer(spec, chunk, grad_in, 0x52B0).wait()
                if kv is not None:
                    kv.wait()
    return run


def _paired(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median times, and ratios within a round (median over rounds), the limit among them."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(rounds):  # one round at a time, to keep each round's samples
        times = time_side_by_side(cases, rounds=1, warmup=2 if i == 0 else 0)
        for name in cases:
            samples[name].append(times[name])
    samples["limit"] = [max(c, m) for c, m in zip(samples["compute"], samples["comm"],
                                                   strict=True)]
    result = {name: statistics.median(v) for name, v in samples.items()}
    for case, base in (("ring", "limit"), ("ring", "compute"), ("ulysses", "ring")):
        if case in samples:
            result[f"{case}/{base}"] = statistics.median(
                a / b for a, b in zip(samples[case], samples[base], strict=True))
    return result


def torch_cp_note(total: int) -> str:
    """What torch's experimental context_parallel does with the layer's attention here.

    One forward+backward of causal SDPA on ``LAYER`` under it, untimed: on CPU with gloo it
    raises (no sharding strategy for the CPU SDPA kernels). Runs on every rank.
    """
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        b, h, d = LAYER["batch"], LAYER["heads"], LAYER["head_dim"]
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        q, k, v = (torch.randn(b, h, total, d) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).sum().backward()
        return "runs here, not timed by this suite"
    except Exception as exc:  # report why it cannot run here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def layer_rank(total: int, rounds: int, document: int | None = None,
               padded: int | None = None) -> dict[str, Any]:
    """One causal attention layer (``LAYER``) at sequence length ``total``.

    ``document``: one row packed with documents of that many tokens (ring attention's
    ``documents``), against a compute that takes each query piece against its own
    document's keys only. ``padded``: that many tokens of left padding (``key_mask``),
    against a compute that takes the kept queries only.
    """
    g = resolve_group(None, "bench")
    b, h, d = LAYER["batch"], LAYER["heads"], LAYER["head_dim"]
    layout = zigzag_layout(total, g.size)
    rows = positions(layout, g.rank)
    torch.manual_seed(g.rank)
    q, k, v = (torch.randn(b, h, len(rows), d, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, len(rows), d)
    visible: Visible | None = None
    if document is not None:
        visible = Documents((torch.arange(total) // document).expand(b, -1), q.device)
    elif padded is not None:
        visible = Padding((torch.arange(total) >= padded).expand(b, -1), q.device)
    spec = RingSpec(group=g, layout=layout, causal=True, window=None, scale=d ** -0.5,
                    kv_groups=1, visible=visible)
    k_full, v_full = (torch.randn(b, h, total, d, requires_grad=True) for _ in range(2))
    longest = max(len(positions(layout, r)) for r in range(g.size))
    chunk = torch.randn(2 * b * h * longest * d)

    def ring() -> None:
        ring_apply(q, k, v, spec).backward(dout)

    spans = _packed_spans(layout, g.rank, document) if document is not None else \
        _padded_spans(layout, g.rank, padded) if padded is not None else \
        _spans(layout, g.rank)

    def compute() -> None:
        _attend(q, k_full, v_full, spans).backward(dout)

    times = _paired({"ring": ring, "compute": compute, "comm": _comm(spec, chunk, 1)}, rounds)
    plain = document is None and padded is None
    saved = _saved_bytes(lambda: ring_apply(q, k, v, spec), set())
    qf = torch.randn(b, h, total, d, requires_grad=True)
    dense = _saved_bytes(lambda: F.scaled_dot_product_attention(qf, k_full, v_full,
                                                                is_causal=True), set())
    case = "attention layer" if plain else \
        f"packed attention layer ({document}-token documents)" if document is not None else \
        f"padded attention layer ({padded} tokens of left padding)"
    return {"case": case, "world_size": g.size, "total": total, **times, "saved": saved,
            "dense_saved": dense}


def _ideal_hf_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: Any, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    state, call = module.__dict__["_tensorpar_context"], kwargs[CALL]
    total = sum(seg.length for r in call.layout for seg in r)
    reps = -(-total // max(1, key.shape[2]))
    k_full = key.repeat(1, 1, reps, 1)[:, :, :total]  # the right size; values do not matter
    v_full = value.repeat(1, 1, reps, 1)[:, :, :total]
    out = _attend(query, k_full, v_full, _spans(call.layout, state.group.rank))
    return out.transpose(1, 2).contiguous(), None


def _set_attention(model: torch.nn.Module, name: str) -> None:
    for module in model.modules():
        conf = getattr(module, "config", None)
        if conf is not None and hasattr(conf, "_attn_implementation"):
            conf._attn_implementation = name


def llama_rank(total: int, rounds: int) -> dict[str, Any]:
    """A 2-layer Llama (``LLAMA``) under context_parallel at sequence length ``total``."""
    import transformers

    from tensorpar.nn import context_parallel

    transformers.AttentionInterface.register(_IDEAL, _ideal_hf_attention)
    g = resolve_group(None, "bench")
    def build() -> Any:
        config = transformers.LlamaConfig(**LLAMA, max_position_embeddings=total)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    dense, model = build(), context_parallel(build())
    ids = torch.randint(0, LLAMA["vocab_size"], (1, total),
                        generator=torch.Generator().manual_seed(0))
    layout = zigzag_layout(total, g.size)
    spec = RingSpec(group=g, layout=layout, causal=True, window=None, scale=1.0, kv_groups=1)
    longest = max(sum(s.length for s in r) for r in layout)
    chunk = torch.randn(2 * LLAMA["num_key_value_heads"] * longest * LLAMA["head_dim"])

    state: Any = model.__dict__["_tensorpar_context"]

    def step(name: str, attention: str = "ring") -> Any:
        def run() -> None:
            _set_attention(model, name)
            state.attention = attention
            model(ids, labels=ids).loss.backward()
        return run

    times = _paired({"ring": step("tensorpar_ring"), "compute": step(_IDEAL),
                     "comm": _comm(spec, chunk, LLAMA["num_hidden_layers"]),
                     "ulysses": step("tensorpar_ring", "ulysses")}, rounds)
    _set_attention(model, "tensorpar_ring")
    state.attention = "ring"
    params = {p.untyped_storage().data_ptr() for m in (model, dense) for p in m.parameters()}
    saved = _saved_bytes(lambda: model(ids, labels=ids), params)
    dense_saved = _saved_bytes(lambda: dense(ids, labels=ids), params)
    return {"case": "2-layer Llama", "world_size": g.size, "total": total, **times,
            "saved": saved, "dense_saved": dense_saved}


def run_rank(total: int, rounds: int) -> list[dict[str, Any]]:
    """Every case at one sequence length; the slowest rank's times, rank 0's bytes.

    The plain layer's row also has ``torch_cp``: `torch_cp_note`.
    """
    rows = [layer_rank(total, rounds), layer_rank(total, rounds, PACKED_DOCUMENT),
            layer_rank(total, rounds, padded=total // 4), llama_rank(total, rounds)]
    rows[0]["torch_cp"] = torch_cp_note(total)
    return rows
