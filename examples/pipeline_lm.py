"""Train a small Llama with pipeline x tensor (x data) parallelism, and check it against dense.

On CPU, 4 processes = 2 pipeline stages x 2 tensor-parallel ranks:

    torchrun --nproc-per-node 4 examples/pipeline_lm.py --pp 2 --tp 2

and, e.g., ``--pp 3 --tp 1 --schedule gpipe``, ``--pp 2 --virtual-stages 2`` (interleaved
1F1B) or ``--dp 2 --pp 2 --tp 1``. Ranks are laid out dp x pp x tp (tensor-parallel ranks
consecutive). Every rank builds the same dense transformers Llama (tiny, float64, built from
a config: nothing is downloaded); ``tensorpar.parallelize`` splits its layers over the
tensor-parallel group and ``tensorpar.nn.pipeline`` keeps this rank's decoder layers (the
embedding on the first stage, the norm and LM head on the last). Each step runs the
schedule over the microbatches, averages the gradients over the data-parallel replicas,
clips them to the dense model's norm over the whole pipeline and takes an AdamW step.

At the end each last-stage rank trains the dense model in one process on the same batches
and checks that the losses agree (float64, 1e-9).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar
from tensorpar.nn import plan_from_transformers, vocab_parallel_cross_entropy

VOCAB, BATCH, SEQ = 128, 8, 16


def build_model(layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=3, head_dim=8, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on whole logits, in the logits' dtype."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def groups(dp: int, pp: int, tp: int) -> tuple:
    """This rank's (dp, pp, tp) groups on a dp x pp x tp layout; every rank makes every group."""
    rank = dist.get_rank()
    coords = [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    me = coords[rank]
    out = {}
    for axis in range(3):
        lines: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            lines.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        for key, ranks in sorted(lines.items()):
            g = dist.new_group(ranks)
            if key == me[:axis] + me[axis + 1:]:
                out[axis] = g
    return out[0], out[1], out[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--virtual-stages", type=int, default=1)
    args = parser.parse_args()

    tensorpar.init_distributed(backend="gloo")  # survives torchrun --max-restarts
    if dist.get_world_size() != args.dp * args.pp * args.tp:
        raise SystemExit(f"dp({args.dp}) * pp({args.pp}) * tp({args.tp}) != world size "
                         f"({dist.get_world_size()})")
    dp_group, pp_group, tp_group = groups(args.dp, args.pp, args.tp)
    replica = dist.get_rank(dp_group)

    def vocab_parallel_loss(local_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits[:, :-1].flatten(0, 1),
                                            ids[:, 1:].flatten(), group=tp_group)

    model = build_model(args.layers)
    if args.tp > 1:  # the LM head stays vocab-parallel: the loss never gathers the logits
        tensorpar.parallelize(model, plan_from_transformers(model), group=tp_group)
    pipe = tensorpar.nn.pipeline(model, group=pp_group, microbatches=args.microbatches,
                                 schedule=args.schedule, virtual_stages=args.virtual_stages,
                                 loss_fn=vocab_parallel_loss if args.tp > 1 else lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    rows = slice(replica * BATCH // args.dp, (replica + 1) * BATCH // args.dp)
    losses = []
    for step in range(args.steps):
        ids = batch(step)[rows]
        loss = pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None)
        tensorpar.pipeline.average_gradients(pipe, group=dp_group)
        tensorpar.nn.clip_grad_norm_(pipe, 1.0)
        opt.step()
        opt.zero_grad()
        if pipe.is_last:  # the replicas' mean is the dense batch's loss
            mean = tensorpar.all_reduce(loss, op="mean", group=dp_group)
            losses.append(float(mean))
            if dist.get_rank() == dist.get_world_size() - 1:
                print(f"step {step}: loss {losses[-1]:.6f}", flush=True)

    if pipe.is_last:
        dense = build_model(args.layers)
        dense_opt = torch.optim.AdamW(dense.parameters(), lr=3e-3)
        for step in range(args.steps):
            ids = batch(step)
            dense_loss = lm_loss(dense(ids).logits, ids)
            dense_loss.backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            dense_opt.step()
            dense_opt.zero_grad()
            if abs(dense_loss.item() - losses[step]) > 1e-9:
                raise SystemExit(f"step {step}: pipeline loss {losses[step]!r} != dense "
                                 f"{dense_loss.item()!r}")
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"OK: {args.steps} steps at dp {args.dp} x pp {args.pp} x tp {args.tp} "
                  f"({args.schedule}, {args.virtual_stages} virtual stages) equal the dense "
                  f"model's losses", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
