"""Context parallelism: ring attention against its ideal, one layer and a 2-layer Llama.

Per rank, forward+backward, float32, causal, the zigzag layout:

- ``ring``: `ring_attention`'s Function on the rank's rows (the layer), or the model under
  `context_parallel` (the Llama).
- ``ideal``: this rank's queries against every key they see, computed locally in one go
  (torch's SDPA per query segment over the key prefix it sees: the same arithmetic, no
  ring), plus the key/value bytes the ring moves at the bandwidth measured in the same run
  (one ring hop of a key/value chunk, timed, times the hops: ``2 (W - 1)`` chunk hops and
  ``W`` gradient hops per attention).
- torch's experimental ``context_parallel`` on the same layer, where it runs.
- ``packed attention layer``: the same layer over a row packed with documents of
  ``PACKED_DOCUMENT`` tokens (ring attention's ``documents``); its ideal computes each
  query segment's pieces against their own document's keys only (what a variable-length
  kernel does), and the paired ``ring/compute`` compares the two in the same rounds.
- ``padded attention layer``: the same layer over a row whose first quarter is left
  padding (ring attention's ``key_mask``); its ideal computes only the kept queries
  against the kept keys they see (a padded query's output is zero).
- ``ulysses`` (the Llama): the same model under ``context_parallel(attention="ulysses")``,
  paired with the ring in the same rounds.
- saved activations per rank (``saved_tensors_hooks``), against the dense layer or model.
"""

from __future__ import annotations

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

__all__ = ["LAYER", "LLAMA", "run_rank"]

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


def _ideal_attention(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
                     layout: Layout, rank: int) -> torch.Tensor:
    """The rank's queries against the keys they see, locally: one SDPA per query segment."""
    outs, at = [], 0
    for seg in layout[rank]:
        end = seg.start + seg.length
        qs = q[:, :, at: at + seg.length]
        at += seg.length
        qpos = torch.arange(seg.start, end).unsqueeze(1)
        mask = torch.arange(end) <= qpos  # (L, end): causal by global position
        outs.append(F.scaled_dot_product_attention(qs, k_full[:, :, :end], v_full[:, :, :end],
                                                   attn_mask=mask))
    return torch.cat(outs, dim=2)


def _ideal_packed(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
                  layout: Layout, rank: int, document: int) -> torch.Tensor:
    """Like `_ideal_attention`, each query piece against its own document's keys only."""
    outs, at = [], 0
    for seg in layout[rank]:
        start = seg.start
        while start < seg.start + seg.length:
            first = start - start % document  # its document's first position
            end = min(seg.start + seg.length, first + document)
            qs = q[:, :, at: at + end - start]
            at += end - start
            qpos = torch.arange(start, end).unsqueeze(1)
            mask = torch.arange(first, end) <= qpos
            outs.append(F.scaled_dot_product_attention(
                qs, k_full[:, :, first:end], v_full[:, :, first:end], attn_mask=mask))
            start = end
    return torch.cat(outs, dim=2)


def _ideal_padded(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
                  layout: Layout, rank: int, first: int) -> torch.Tensor:
    """Like `_ideal_attention`, the kept queries (from ``first`` on) against the kept keys."""
    outs, at = [], 0
    for seg in layout[rank]:
        end = seg.start + seg.length
        padded = min(max(first - seg.start, 0), seg.length)
        outs.append(q.new_zeros((*q.shape[:2], padded, v_full.shape[-1])))
        qs = q[:, :, at + padded: at + seg.length]
        at += seg.length
        if qs.shape[2]:
            qpos = torch.arange(seg.start + padded, end).unsqueeze(1)
            mask = torch.arange(first, end) <= qpos
            outs.append(F.scaled_dot_product_attention(
                qs, k_full[:, :, first:end], v_full[:, :, first:end], attn_mask=mask))
    return torch.cat(outs, dim=2)


def _hop(spec: RingSpec, chunk: torch.Tensor) -> Any:
    recv = torch.empty_like(chunk)

    def run() -> None:
        _Transfer(spec, chunk, recv, 0x52AF).wait()
    return run


def _torch_cp_layer(total: int, rounds: int) -> tuple[float | None, str]:
    """Time torch's experimental context_parallel on one projection + SDPA layer, or why not."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        b, h, d = LAYER["batch"], LAYER["heads"], LAYER["head_dim"]
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        proj = torch.nn.Linear(h * d, 3 * h * d)
        x = torch.randn(b, total, h * d)

        def step() -> None:
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
                q, k, v = proj(x).view(b, -1, 3, h, d).permute(2, 0, 3, 1, 4)
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return time_side_by_side({"torch": step}, rounds=rounds)["torch"], ""
    except Exception as exc:  # report why it cannot run here
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def layer_rank(total: int, rounds: int, document: int | None = None,
               padded: int | None = None) -> dict[str, Any]:
    """One causal attention layer (``LAYER``) at sequence length ``total``.

    ``document``: one row packed with documents of that many tokens (ring attention's
    ``documents``), against an ideal that computes each query piece against its own
    document's keys only. ``padded``: that many tokens of left padding (``key_mask``),
    against an ideal that computes the kept queries only. torch's context_parallel is run
    on the plain layer only.
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

    def compute() -> None:
        if document is not None:
            out = _ideal_packed(q, k_full, v_full, layout, g.rank, document)
        elif padded is not None:
            out = _ideal_padded(q, k_full, v_full, layout, g.rank, padded)
        else:
            out = _ideal_attention(q, k_full, v_full, layout, g.rank)
        out.backward(dout)

    times = time_side_by_side({"ring": ring, "compute": compute, "hop": _hop(spec, chunk)},
                              rounds=rounds, pairs=(("ring", "compute"),))
    hops = 2 * (g.size - 1) + g.size
    ideal = times["compute"] + hops * times["hop"]
    plain = document is None and padded is None
    torch_time, torch_note = _torch_cp_layer(total, max(1, rounds // 2)) if plain else \
        (None, "")
    saved = _saved_bytes(lambda: ring_apply(q, k, v, spec), set())
    qf = torch.randn(b, h, total, d, requires_grad=True)
    dense = _saved_bytes(lambda: F.scaled_dot_product_attention(qf, k_full, v_full,
                                                                is_causal=True), set())
    case = "attention layer" if plain else \
        f"packed attention layer ({document}-token documents)" if document is not None else \
        f"padded attention layer ({padded} tokens of left padding)"
    return {"case": case, "world_size": g.size, "total": total, **times,
            "ideal": ideal, "ring/ideal": times["ring"] / ideal, "torch_cp": torch_time,
            "torch_note": torch_note, "saved": saved, "dense_saved": dense}


def _ideal_hf_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: Any, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    state, call = module.__dict__["_tensorpar_context"], kwargs[CALL]
    total = sum(seg.length for r in call.layout for seg in r)
    reps = -(-total // max(1, key.shape[2]))
    k_full = key.repeat(1, 1, reps, 1)[:, :, :total]  # the right size; values do not matter
    v_full = value.repeat(1, 1, reps, 1)[:, :, :total]
    out = _ideal_attention(query, k_full, v_full, call.layout, state.group.rank)
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

    times = time_side_by_side({"ring": step("tensorpar_ring"), "compute": step(_IDEAL),
                               "ulysses": step("tensorpar_ring", "ulysses"),
                               "hop": _hop(spec, chunk)},
                              rounds=rounds, pairs=(("ring", "compute"), ("ulysses", "ring")))
    _set_attention(model, "tensorpar_ring")
    state.attention = "ring"
    layers = LLAMA["num_hidden_layers"]
    ideal = times["compute"] + layers * (2 * (g.size - 1) + g.size) * times["hop"]
    params = {p.untyped_storage().data_ptr() for m in (model, dense) for p in m.parameters()}
    saved = _saved_bytes(lambda: model(ids, labels=ids), params)
    dense_saved = _saved_bytes(lambda: dense(ids, labels=ids), params)
    return {"case": "2-layer Llama", "world_size": g.size, "total": total, **times,
            "ideal": ideal, "ring/ideal": times["ring"] / ideal, "torch_cp": None,
            "torch_note": "not run on the model (see the layer row)", "saved": saved,
            "dense_saved": dense_saved}


def run_rank(total: int, rounds: int) -> list[dict[str, Any]]:
    """Every case at one sequence length; the slowest rank's times, rank 0's bytes."""
    return [layer_rank(total, rounds), layer_rank(total, rounds, PACKED_DOCUMENT),
            layer_rank(total, rounds, padded=total // 4), llama_rank(total, rounds)]
