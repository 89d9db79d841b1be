"""Sequence parallelism on a Llama stack: tensorpar vs DTensor's ``SequenceParallel`` vs the floor.

The model is a small transformers ``LlamaModel`` (sdpa attention, float32; sizes in `SIZES`),
one forward+backward per step with the loss ``mean(last_hidden_state ** 2)``, the same on
every rank. Timed side by side:

- ``tensorpar_sp``: ``parallelize(model, plan_from_transformers(model, sequence_parallel=True))``;
- ``tensorpar_tp``: the same without sequence parallelism (an all-reduce per row-parallel
  layer each way), for reference;
- ``dtensor_sp``: ``parallelize_module`` with a plan in the style of torchtitan's: q/k/v/gate/up
  ``ColwiseParallel``, o_proj/down_proj ``RowwiseParallel(output_layouts=Shard(1))``, the
  norms ``SequenceParallel()``, attention and MLP gathering their input
  (``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate()``). As in tensorpar's plan, the
  embedding is split by vocabulary and its output whole (transformers' Llama reads the
  embedding output's length for the positions and the mask), and the first decoder layer
  slices its input (``PrepareModuleInput``: ``Replicate()`` -> ``Shard(1)``);
- ``floor``: this rank's share of the compute, run by hand on the same layers at shard sizes
  (attention and MLP on the whole sequence with this rank's heads and features, norms and
  residual adds on this rank's slice; concatenating the slice stands for each all-gather's
  output, slicing the output for each reduce-scatter's), plus the raw collectives both
  implementations issue, on the same bytes, back to back: the embedding's all-reduce, the
  flat all-gathers and reduce-scatters of each direction (``dist.all_gather_single``,
  ``dist.reduce_scatter_single``, or their older names), and one all-reduce per norm weight's
  gradient. ``floor_again`` times it twice (the run's noise). The run also counts the
  collectives tensorpar issues in one step, which should be the floor's list exactly.

Before timing, every implementation's loss and norm-weight gradients are checked against the
dense model's, so all three compute the same thing.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SIZES", "collective_counts", "run_rank"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SIZES: dict[str, int] = {"vocab": 1024, "hidden": 256, "intermediate": 704, "layers": 2,
                         "heads": 8, "kv_heads": 4, "head_dim": 32, "batch": 4, "seq": 128}
"""The model and the batch: a step takes tens of milliseconds on one CPU core."""


def _model(sizes: dict[str, int], *, heads: int | None = None, kv_heads: int | None = None,
           intermediate: int | None = None, vocab: int | None = None) -> nn.Module:
    """The Llama stack with the same weights on every rank (keywords: a shard's sizes)."""
    from transformers import LlamaConfig, LlamaModel

    options: dict[str, Any] = {"attn_implementation": "sdpa", "use_cache": False}
    config = LlamaConfig(
        vocab_size=vocab or sizes["vocab"], hidden_size=sizes["hidden"],
        intermediate_size=intermediate or sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=heads or sizes["heads"],
        num_key_value_heads=kv_heads or sizes["kv_heads"], head_dim=sizes["head_dim"],
        max_position_embeddings=max(sizes["seq"], 8), **options)
    torch.manual_seed(0)
    model: nn.Module = LlamaModel(config)
    return model


def _dtensor_model(sizes: dict[str, int]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                use_local_output=True)
    plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Shard(1),), use_local_output=True),
        "norm": SequenceParallel(),  # output Shard(1); the loss takes its full_tensor()
    }
    for i in range(sizes["layers"]):
        prefix = f"layers.{i}"
        plan |= {f"{prefix}.input_layernorm": SequenceParallel(),
                 f"{prefix}.post_attention_layernorm": SequenceParallel(),
                 f"{prefix}.self_attn": gather,
                 f"{prefix}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                     desired_input_layouts=(Replicate(),),
                                                     use_local_output=True),
                 f"{prefix}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                 f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}
        plan |= {f"{prefix}.{p}": ColwiseParallel()
                 for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "mlp.gate_proj", "mlp.up_proj")}
    return parallelize_module(_model(sizes), mesh, plan)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids).last_hidden_state
    if hasattr(hidden, "full_tensor"):  # DTensor's last norm leaves the sequence sharded
        hidden = hidden.full_tensor()
    loss: torch.Tensor = hidden.pow(2).mean()
    return loss


def _shard(n: int) -> int:
    return len(torch.tensor_split(torch.empty(n), dist.get_world_size())[dist.get_rank()])


def _floor_forward(local: Any, ids: torch.Tensor) -> torch.Tensor:
    """The sequence-parallel forward of this rank's shard, with no communication."""
    world, rank = dist.get_world_size(), dist.get_rank()
    seq = ids.shape[1]
    start, length = rank * seq // world, seq // world

    def whole(x: torch.Tensor) -> torch.Tensor:  # the all-gather's output, locally
        return torch.cat([x] * world, dim=1)

    h = local.embed_tokens(ids % local.embed_tokens.num_embeddings)  # (B, T, D): own rows
    rope = local.rotary_emb(h, torch.arange(seq).unsqueeze(0))
    h = h.narrow(1, start, length)  # (B, T/tp, D)
    for layer in local.layers:
        a, _ = layer.self_attn(hidden_states=whole(layer.input_layernorm(h)),
                               attention_mask=None, position_embeddings=rope)
        h = h + a.narrow(1, start, length)
        m = layer.mlp(whole(layer.post_attention_layernorm(h)))
        h = h + m.narrow(1, start, length)
    return whole(local.norm(h)).pow(2).mean()


def collective_counts(layers: int) -> dict[str, int]:
    """The collectives of one sequence-parallel step (forward+backward) of ``layers`` layers.

    Per layer, forward: an all-gather before attention and the MLP, a reduce-scatter after
    o_proj and down_proj; backward: the duals. Plus the first layer's split (an all-gather in
    backward), the last norm's gather (forward), the embedding's all-reduce (forward) and one
    all-reduce per norm weight's gradient.
    """
    return {"all_gather": 4 * layers + 2, "reduce_scatter": 4 * layers, "all_reduce": 1,
            "all_reduce_norm": 2 * layers + 1}


def _check(models: dict[str, nn.Module], dense: nn.Module, ids: torch.Tensor) -> None:
    """Each model's loss and norm-weight gradients against the dense model's (float32)."""
    names = ["norm.weight", "layers.0.input_layernorm.weight",
             "layers.0.post_attention_layernorm.weight"]
    expected = _loss(dense, ids)
    expected.backward()
    grads = {n: dense.get_parameter(n).grad for n in names}
    dense.zero_grad(set_to_none=True)
    for label, model in models.items():
        loss = _loss(model, ids)
        loss.backward()
        _close(loss, expected, f"{label}: the loss", rtol=1e-5, atol=1e-7)
        for n in names:
            got: Any = model.get_parameter(n).grad
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            _close(got, grads[n], f"{label}: the gradient of {n}", rtol=1e-4, atol=1e-6)
        model.zero_grad(set_to_none=True)


def _close(got: Any, expected: Any, what: str, *, rtol: float, atol: float) -> None:
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"sequence.run_rank: {what} differs from the dense model's: "
                             f"{exc}") from None


def _tally(keys: list[str]) -> dict[str, int]:
    """How many times each ``"kind nbytes"`` occurs (a JSON-ready ``Counter``)."""
    return dict(sorted(Counter(keys).items()))


def run_rank(rounds: int, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Time one forward+backward of each case; every rank returns the same figures.

    Args:
        rounds: timed rounds (each runs every case once).
        sizes: the model and batch (`SIZES` when ``None``); ``seq`` a multiple of the world
            size (the floor's raw collectives take equal slices).

    Returns:
        Median seconds per step of each case (and ``<case>_cpu``), the paired ratios
        ``tensorpar_sp/dtensor_sp``, ``tensorpar_sp/floor``, ``tensorpar_sp/tensorpar_tp``
        and ``floor_again/floor``, with ``tp`` and ``sizes``; ``tensorpar_sp_collectives``
        and ``floor_collectives``: the collectives of one step (``"kind nbytes"`` -> count)
        that tensorpar issued and that the floor issues, which should be the same.
    """
    from tensorpar.bench.workloads._timing import time_side_by_side
    from tensorpar.comm._comm import CommCounter
    from tensorpar.nn import plan_from_transformers
    from tensorpar.nn.convert import parallelize

    sizes = dict(SIZES if sizes is None else sizes)
    world = dist.get_world_size()
    if sizes["seq"] % world:
        raise ValueError(f"sequence.run_rank: sizes['seq'] must be a multiple of the world "
                         f"size {world}, got {sizes['seq']}")
    ids = torch.randint(sizes["vocab"], (sizes["batch"], sizes["seq"]),
                        generator=torch.Generator().manual_seed(1))
    models: dict[str, nn.Module] = {}
    for label, sp in (("tensorpar_sp", True), ("tensorpar_tp", False)):
        model = _model(sizes)
        models[label] = parallelize(model, plan_from_transformers(model, sequence_parallel=sp))
    models["dtensor_sp"] = _dtensor_model(sizes)
    _check(models, _model(sizes), ids)
    with CommCounter() as counter:  # what tensorpar issues in one step, for the floor's list
        _loss(models["tensorpar_sp"], ids).backward()
    models["tensorpar_sp"].zero_grad(set_to_none=True)
    issued = _tally([f"{r.kind} {r.nbytes}" for r in counter.records])
    local = _model(sizes, heads=_shard(sizes["heads"]), kv_heads=_shard(sizes["kv_heads"]),
                   intermediate=_shard(sizes["intermediate"]), vocab=_shard(sizes["vocab"]))

    full = sizes["batch"] * sizes["seq"] * sizes["hidden"]  # flat: the same bytes
    part = full // world
    counts = collective_counts(sizes["layers"])
    # (zeros: the buffers reduced in place stay finite over the rounds)
    gathers = [(torch.empty(full), torch.zeros(part)) for _ in range(counts["all_gather"])]
    scatters = [(torch.empty(part), torch.zeros(full)) for _ in range(counts["reduce_scatter"])]
    reduces = [torch.zeros(full)] + [torch.zeros(sizes["hidden"])
                                     for _ in range(counts["all_reduce_norm"])]
    floor_issued = _tally([*(f"all_gather {x.nbytes}" for _, x in gathers),
                           *(f"reduce_scatter {x.nbytes}" for _, x in scatters),
                           *(f"all_reduce {t.nbytes}" for t in reduces)])
    if floor_issued != issued:  # the floor must move what tensorpar moves, no more or less
        raise RuntimeError(f"sequence benchmark: the floor's collectives {floor_issued} are "
                           f"not tensorpar's {issued}")

    def step(model: nn.Module) -> None:
        _loss(model, ids).backward()
        model.zero_grad(set_to_none=True)

    def floor() -> None:
        _floor_forward(local, ids).backward()
        local.zero_grad(set_to_none=True)
        for out, x in gathers:
            _all_gather(out, x)
        for out, x in scatters:
            _reduce_scatter(out, x)
        for t in reduces:
            dist.all_reduce(t)

    cases: dict[str, Callable[[], object]] = {
        "floor": floor, **{k: functools.partial(step, m) for k, m in models.items()},
        "floor_again": floor}
    pairs = (("tensorpar_sp", "dtensor_sp"), ("tensorpar_sp", "floor"),
             ("tensorpar_sp", "tensorpar_tp"), ("floor_again", "floor"))
    times = time_side_by_side(cases, rounds=rounds, cpu=True, pairs=pairs, rotate=True)
    return {"table": "sequence", "workload": "llama-sp", "tp": world, "sizes": sizes,
            "tensorpar_sp_collectives": issued, "floor_collectives": floor_issued, **times}
