"""Train a small Llama with its rows split over the ranks (context parallelism); check vs dense.

On CPU, 4 processes = 2 data-parallel replicas x 2 context-parallel ranks:

    torchrun --nproc-per-node 4 examples/context_parallel_lm.py --dp 2 --cp 2

and, e.g., ``--cp 4``, ``--cp 2 --tp 2`` (tensor parallelism inside each context rank),
``--attention ulysses`` (all-to-alls around SDPA instead of the ring) or ``--packed`` (each
row holds several documents, kept apart by their restarting ``position_ids``). Ranks are
laid out dp x cp x tp (tensor-parallel ranks consecutive). Every rank builds the same dense
transformers Llama (tiny, float64, built from a config: nothing is downloaded);
``tensorpar.parallelize`` splits its layers over the tensor-parallel group and
``tensorpar.nn.context_parallel`` makes each rank keep its share of every row's positions.
Every rank of a context group calls the model with its replica's whole batch; ``out.loss``
is that batch's loss on each of them. The data-parallel wrapper averages the gradients over
the replicas, and each step clips them and takes an AdamW step.

At the end rank 0 trains the dense model in one process on the same global batches and
checks that the losses agree (float64, but transformers computes the loss in float32: the
bar is 1e-6 of the loss, a few float32 roundings).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorpar
from tensorpar.nn import DistributedDataParallel, context_parallel, plan_from_transformers

VOCAB, BATCH, SEQ = 96, 4, 96


def build_model(layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=3, head_dim=8, max_position_embeddings=SEQ,
        use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def batch(step: int, packed: bool) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: token ids, labels and, packed, restarting positions."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    inputs = {"input_ids": ids, "labels": ids}
    if packed:  # documents of 5 to 40 tokens, their positions counting from 0 at each start
        positions = torch.empty_like(ids)
        for row in positions:
            at = 0
            while at < SEQ:
                length = int(torch.randint(5, 41, (1,), generator=g))
                row[at:at + length] = torch.arange(min(length, SEQ - at))
                at += length
        inputs["position_ids"] = positions
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel replicas (default: the ranks --cp x --tp leaves)")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--attention", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--packed", action="store_true", help="several documents per row")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    tensorpar.init_distributed(backend="gloo")  # survives torchrun --max-restarts
    if args.dp is None:
        args.dp = max(dist.get_world_size() // (args.cp * args.tp), 1)
    if dist.get_world_size() != args.dp * args.cp * args.tp:
        raise SystemExit(f"dp({args.dp}) * cp({args.cp}) * tp({args.tp}) != world size "
                         f"({dist.get_world_size()})")
    if BATCH % args.dp:
        raise SystemExit(f"--dp {args.dp} must divide the global batch of {BATCH} rows")
    mesh = init_device_mesh("cpu", (args.dp, args.cp, args.tp), mesh_dim_names=("dp", "cp", "tp"))
    dp_group, cp_group, tp_group = (mesh[name].get_group() for name in ("dp", "cp", "tp"))
    replica = mesh.get_local_rank("dp")

    model = build_model(args.layers)
    if args.tp > 1:  # the LM head stays vocab-parallel: the loss never gathers the logits
        tensorpar.parallelize(model, plan_from_transformers(model), group=tp_group)
    context_parallel(model, group=cp_group, attention=args.attention)
    ddp = DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = slice(replica * BATCH // args.dp, (replica + 1) * BATCH // args.dp)
    losses = []
    for step in range(args.steps):
        inputs = {k: v[rows] for k, v in batch(step, args.packed).items()}
        loss = ddp(**inputs).loss  # this replica's batch's loss, on every rank of its group
        loss.backward()
        tensorpar.nn.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        mean = tensorpar.all_reduce(loss.detach(), op="mean", group=dp_group)
        losses.append(float(mean))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)

    if dist.get_rank() == 0:
        dense = build_model(args.layers)
        dense_opt = torch.optim.AdamW(dense.parameters(), lr=3e-3)
        worst = 0.0
        for step in range(args.steps):
            dense_loss = dense(**batch(step, args.packed)).loss
            dense_loss.backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            dense_opt.step()
            dense_opt.zero_grad()
            error = abs(dense_loss.item() - losses[step]) / abs(dense_loss.item())
            worst = max(worst, error)
            if error > 1e-6:
                raise SystemExit(f"step {step}: context-parallel loss {losses[step]!r} != "
                                 f"dense {dense_loss.item()!r}")
        print(f"OK: {args.steps} steps at dp {args.dp} x cp {args.cp} x tp {args.tp} "
              f"({args.attention}{', packed' if args.packed else ''}, {SEQ} tokens a row, "
              f"{SEQ // args.cp} a rank) equal the dense model's losses within {worst:.1e} "
              f"(relative)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
