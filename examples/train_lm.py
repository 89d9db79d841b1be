"""Train a small GPT-style language model with tensor x pipeline x data parallelism.

On CPU, 4 processes = 2 data-parallel replicas x 2 tensor-parallel ranks:

    torchrun --nproc-per-node 4 examples/train_lm.py

or 2 pipeline stages (x 2 tensor-parallel ranks):

    torchrun --nproc-per-node 2 examples/train_lm.py --pp 2 --tp 1
    torchrun --nproc-per-node 4 examples/train_lm.py --pp 2 --tp 2

On GPUs the same script picks NCCL and cuda:LOCAL_RANK (e.g. --nproc-per-node 8 --tp 4).

The corpus is the Python standard library's own source, read as bytes (vocabulary 256), so
nothing is downloaded. The model is parallelised from its dense weights by a plan: attention
heads, MLP and the (tied) embedding / LM head are split across the tensor-parallel group, and
BucketedAllReduce averages gradients across the data-parallel group; gradients are clipped to
the dense model's norm (tensorpar.nn.clip_grad_norm_). With --pp, tensorpar.nn.pipeline cuts
the model into stages by the blocks GPT.pipeline_blocks() lists (the embedding, each
transformer block, the norm and head) and runs each step over --microbatches microbatches;
tensorpar.pipeline.average_gradients then averages the gradients across the replicas. At the
end rank 0 checks that the loss fell and that a single process training the dense model on the
same batches gives the same losses.

Checkpoints (model and optimizer state sharded with torch.distributed.checkpoint, plus the
step, the losses so far and the RNG state; the data position is the step) go to
OUT/checkpoints/step_NNNNNN, written under a temporary name and renamed when complete; the
file OUT/checkpoints/LATEST names the newest complete one and is replaced last, so a crash
during a save leaves the previous checkpoint in force. A run without --resume starts over: it
sets the checkpoints it finds aside first, in OUT/checkpoints.previous. Stop a run and
continue it, at the same or another --tp (same global batch), with the losses of a run that
was never stopped:

    torchrun --nproc-per-node 4 examples/train_lm.py --steps 300 --stop-at 150
    torchrun --nproc-per-node 4 examples/train_lm.py --steps 300 --resume --tp 4 --batch 16
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tensorpar
from tensorpar.nn import Colwise, Rowwise, vocab_parallel_cross_entropy

VOCAB, CONTEXT, DIM, HEADS, HEAD_DIM, LAYERS = 256, 64, 96, 6, 16, 2
PLAN = {
    "embed": "vocab",                                       # rows of the byte vocabulary
    "blocks.*.attn.[qkv]": Colwise(multiple_of=HEAD_DIM),  # whole heads on every rank
    "blocks.*.attn.out": Rowwise(multiple_of=HEAD_DIM),
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "colwise",                                      # tied to embed: the same rows
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, HEADS * HEAD_DIM) for _ in range(3))
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x):  # the head count is read off the tensors: HEADS / tp per rank
        q, k, v = (rearrange(p(x), "b t (h d) -> b h t d", d=HEAD_DIM)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential()
        self.mlp.up, self.mlp.act, self.mlp.down = (nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                    nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(CONTEXT, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)        # it is the LM head too

    def forward(self, ids):                                # (B, T) -> (B, T, V / tp)
        x = self.embed_positions(ids)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def embed_positions(self, ids):                        # (B, T) -> (B, T, DIM)
        return self.embed(ids) + self.pos[: ids.shape[1]]

    def logits(self, x):                                   # (B, T, DIM) -> (B, T, V / tp)
        return self.head(self.norm(x))

    def pipeline_blocks(self):
        """The model as tensorpar.nn.pipeline cuts it: (dense names held, function), in order."""
        return [(("embed", "pos"), self.embed_positions),
                *(((f"blocks.{i}",), block) for i, block in enumerate(self.blocks)),
                (("norm", "head"), self.logits)]


def corpus(nbytes):
    """The first ``nbytes`` of the standard library's sources, as byte ids."""
    data = bytearray()
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= nbytes:
            break
    return torch.tensor(list(data[:nbytes]), dtype=torch.long)


def global_batch(data, step, rows):
    """The same ``rows`` windows on every rank: inputs and next-byte targets."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (rows,), generator=g)
    windows = torch.stack([data[s: s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]



def dense_losses(data, args, device):
    """The reference: one process, the dense model, the same global batches."""
    torch.manual_seed(0)
    model = GPT().to(device, args.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in global_batch(data, step, args.batch * args.dp))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="microbatches per step with --pp (at most --batch)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe", "zero-bubble"], default="1f1b",
                        help="pipeline schedule with --pp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="train_lm_out", help="checkpoint and plot directory")
    parser.add_argument("--max-loss", type=float, default=2.8,
                        help="the check: the last 10 steps' mean loss must fall below this")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint every N steps (always at the end and at --stop-at)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this many steps (checkpoint saved), as if interrupted")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --out if there "
                             "is one, else start fresh (the command line torchrun "
                             "--max-restarts repeats)")
    parser.add_argument("--crash-in-save", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)

    device = tensorpar.init_distributed()  # survives torchrun --max-restarts
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % (args.tp * args.pp):
        raise SystemExit(f"tp({args.tp}) * pp({args.pp}) does not divide the {world} processes")
    args.dp = world // (args.tp * args.pp)
    mesh = init_device_mesh(device.type, (args.dp, args.pp, args.tp),
                            mesh_dim_names=("dp", "pp", "tp"))
    data = corpus(2_000_000)

    torch.manual_seed(0)                                    # the same dense weights everywhere
    model = GPT().to(device, args.dtype)
    tensorpar.parallelize(model, PLAN, group=mesh["tp"])
    reducer = pipe = None
    if args.pp > 1:  # this rank's stage of the model, under the dense names
        def loss_fn(local_logits, y):                     # a microbatch's mean over tokens
            return vocab_parallel_cross_entropy(local_logits.flatten(0, 1), y.flatten(),
                                                group=mesh["tp"])
        model = pipe = tensorpar.nn.pipeline(model, group=mesh["pp"], loss_fn=loss_fn,
                                             microbatches=args.microbatches,
                                             schedule=args.schedule)
    else:
        reducer = tensorpar.BucketedAllReduce(model, group=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    out = pathlib.Path(args.out)
    first, losses = 0, []
    saved = seen_by_rank_0((out / "checkpoints" / "LATEST").exists(), device)
    if args.resume and saved:
        first, losses = load_checkpoint(out / "checkpoints", model, opt, args)
        if rank == 0:
            print(f"resumed at step {first} from {out / 'checkpoints'} (attempt "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
    elif args.resume and rank == 0:
        print(f"no checkpoint in {out / 'checkpoints'}: starting at step 0", flush=True)
    elif saved:  # a new run where one saved before
        set_aside(out / "checkpoints")
    last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    if last < first:  # (every rank read the same checkpoint: every rank stops here)
        raise SystemExit(f"the checkpoint in {out / 'checkpoints'} is at step {first}, past "
                         f"the step to stop at ({last}): nothing to train, nothing to save")

    start = time.perf_counter()
    for step in range(first, last):
        if step == args.kill_at and rank == world - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run (for the restart test)
        x, y = global_batch(data, step, args.batch * args.dp)
        mine = slice(mesh["dp"].get_local_rank() * args.batch,
                     (mesh["dp"].get_local_rank() + 1) * args.batch)
        x, y = x[mine].to(device), y[mine].to(device)
        if pipe is not None:  # every microbatch's forward and backward, in the schedule's order
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            tensorpar.pipeline.average_gradients(pipe, group=mesh["dp"])
            # the loss lives on the last stage: a placeholder elsewhere
            loss = tensorpar.broadcast(loss, src=args.pp - 1, group=mesh["pp"])
        else:
            local_logits = model(x)                         # (B, T, V / tp)
            loss = vocab_parallel_cross_entropy(local_logits.flatten(0, 1), y.flatten(),
                                                group=mesh["tp"])
            loss.backward()                                 # gradients averaged over dp here
        tensorpar.nn.clip_grad_norm_(model, args.clip)      # the dense model's norm
        opt.step()
        opt.zero_grad()
        global_loss = tensorpar.all_reduce(loss.detach(), op="mean", group=mesh["dp"])
        losses.append(global_loss.item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            rate = (step + 1 - first) * args.batch * args.dp * CONTEXT \
                / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {losses[-1]:.3f}  {rate:,.0f} tokens/s", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < last:
            save_checkpoint(out / "checkpoints", step + 1, model, opt, losses, args)

    if last > first:  # (at last == first the checkpoint LATEST names is this state)
        save_checkpoint(out / "checkpoints", last, model, opt, losses, args)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        if reducer is not None:
            print(f"{last - first} steps at dp {args.dp} x tp {args.tp}; waited "
                  f"{reducer.sync_wait_seconds:.2f} s at the gradient sync; checkpoint in "
                  f"{out / 'checkpoints'}")
        else:
            print(f"{last - first} steps at dp {args.dp} x pp {args.pp} x tp {args.tp} "
                  f"({args.schedule}, {args.microbatches} microbatches); checkpoint in "
                  f"{out / 'checkpoints'}")
    if last < args.steps:  # stopped early, as if interrupted: nothing to check yet
        if rank == 0:
            print(f"stopped at step {last}: OK", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    if rank == 0:
        reference = dense_losses(data, args, device)
        early = max(abs(a - b) for a, b in zip(losses[:20], reference[:20], strict=True))
        final, final_ref = (sum(v[-10:]) / len(v[-10:]) for v in (losses, reference))
        plot(losses, reference, out / "loss.png")
        # float32 trajectories drift apart over hundreds of Adam steps: tight early, 3% late;
        # float64 ones agree to rounding over the first 20 steps
        tol = 1e-10 if args.dtype == torch.float64 else 1e-3
        ok = final < args.max_loss and early < tol and abs(final - final_ref) < 0.03 * final_ref
        print(f"check: final loss {final:.3f} (< {args.max_loss}); against one process "
              f"training the dense model: first 20 steps within {early:.1e} (< {tol:.0e}), "
              f"final loss {final_ref:.3f} (within 3%): {'OK' if ok else 'FAILED'}", flush=True)
    else:
        ok = True
    verdict = torch.tensor([int(ok)])
    dist.broadcast(verdict, 0)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if verdict.item() else 1)


def seen_by_rank_0(flag, device):
    """Rank 0's ``flag`` on every rank: one answer where ranks may see a file differently
    (another machine's disk, or a moment later)."""
    agreed = torch.tensor([int(flag)], device=device)
    dist.broadcast(agreed, src=0)
    return bool(agreed.item())


def set_aside(root):
    """A run without --resume starts over: the previous run's checkpoints move aside.

    They go to ``root`` + ``.previous`` (replacing what was there), so its own saves never
    meet a checkpoint it did not write.
    """
    previous = root.with_name(root.name + ".previous")
    if dist.get_rank() == 0:
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(root, previous)
        print(f"a new run (no --resume): the checkpoints in {root} set aside in {previous}",
              flush=True)
    dist.barrier()


def save_checkpoint(root, step, model, opt, losses, args):
    """Model, optimizer and loop state at ``step``; LATEST moves only once it is complete.

    DCP writes into ``step_N.tmp``; after every rank has finished, rank 0 renames it to
    ``step_N`` and then replaces LATEST (a write to a temporary file and an atomic rename).
    A crash before that leaves LATEST naming the previous checkpoint. The step LATEST
    already names is never saved again (its directory would be gone for a moment).
    """
    rank = dist.get_rank()
    final, temp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    latest = root / "LATEST"
    if latest.exists() and latest.read_text().strip() == final.name:
        raise RuntimeError(f"{final} is the checkpoint LATEST names: not saved over")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)
    dist.barrier()
    if args.crash_in_save == step and rank == dist.get_world_size() - 1:
        os._exit(3)  # a rank dies in the middle of the save (for the crash test)
    state = {"model": tensorpar.sharded_state_dict(model),
             "optim": tensorpar.sharded_optimizer_state_dict(model, opt),
             "loop": {"step": step, "losses": list(losses), "global_batch": args.batch * args.dp,
                      **rng_states(args)}}
    dcp.save(state, checkpoint_id=str(temp))
    dist.barrier()                                          # every rank has written its part
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temp, final)
        pointer = root / "LATEST.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "LATEST")               # the commit point
        keep = {p.name for p in sorted(root.glob("step_??????"))[-2:]}  # the newest two
        for old in root.glob("step_*"):                    # and no stale temporary ones
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(root, model, opt, args):
    """Load the checkpoint LATEST names into ``model`` and ``opt``; return (step, losses)."""
    name = (root / "LATEST").read_text().strip()
    if not (root / name / ".metadata").exists():
        raise SystemExit(f"--resume: {root / 'LATEST'} names {name}, which holds no complete "
                         f"checkpoint (removed by hand?); point LATEST at another step_* "
                         f"directory there, or start over without --resume")
    loop = {"step": 0, "losses": [], "global_batch": 0, **saved_rng(root / name)}
    state = {"model": tensorpar.sharded_state_dict(model),
             "optim": tensorpar.sharded_optimizer_state_dict(model, opt), "loop": loop}
    dcp.load(state, checkpoint_id=str(root / name))
    tensorpar.load_sharded_state_dict(model, state["model"])
    tensorpar.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    loop = state["loop"]
    if loop["global_batch"] != args.batch * args.dp:
        raise SystemExit(f"--resume: the checkpoint was trained with a global batch of "
                         f"{loop['global_batch']} sequences, this run has {args.batch} x "
                         f"{args.dp} replicas = {args.batch * args.dp}; pass --batch "
                         f"{loop['global_batch'] // args.dp}")
    restore_rng(loop, args)
    return loop["step"], list(loop["losses"])


def rng_states(args):
    """Every rank's RNG states in rank order, and the layout they belong to, for the loop state.

    Saved as tensors every rank holds alike: DCP keeps one copy of a tensor that every rank
    saves under the same name, so a rank's own state saved as it is would come back as one
    rank's on every rank (ranks whose dropout is seeded apart would resume in step).
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    mine = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    states = {"rng": torch.stack([cpu for cpu, _ in every]),
              "rng_layout": torch.tensor([args.dp, args.pp, args.tp])}
    if cuda:
        states["cuda_rng"] = torch.stack([gpu for _, gpu in every])
    return states


def saved_rng(path):
    """Room for the RNG states `rng_states` saved in ``path``, shaped as its metadata says.

    A checkpoint of an earlier version of this script holds one state for every rank; one
    saved without a GPU has no GPU states (the GPU's generator stays as seeded).
    """
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    room = {name: torch.empty(tuple(meta[f"loop.{name}"].size),
                              dtype=meta[f"loop.{name}"].properties.dtype)
            for name in ("rng", "cuda_rng", "rng_layout") if f"loop.{name}" in meta}
    if "cuda_rng" in room and not torch.cuda.is_available():
        del room["cuda_rng"]  # (resumed without a GPU: nothing to restore it to)
    return room


def restore_rng(loop, args):
    """Set this rank's RNG states to those `rng_states` saved for it (loaded into ``loop``).

    A rank takes its own row where the run has the checkpoint's layout (dp x pp x tp); at
    another layout the rows belong to other positions, so every row must be the same.
    """
    saved = {name: loop[name] for name in ("rng", "cuda_rng", "rng_layout") if name in loop}
    layout = saved.pop("rng_layout", None)
    states = {name: t if t.dim() == 2 else t[None] for name, t in saved.items()}
    same = layout is not None and layout.tolist() == [args.dp, args.pp, args.tp]
    if not same and any(not torch.equal(t[0], row) for t in states.values() for row in t):
        raise SystemExit(f"--resume: the checkpoint's processes had RNG states of their own, "
                         f"and this run's layout (dp {args.dp} x pp {args.pp} x tp {args.tp}) "
                         f"is not theirs ({layout.tolist()} as dp x pp x tp): resume at it")
    mine = dist.get_rank() if same else 0
    # (a copy: torch.set_rng_state given a row of the stack, a view at an offset, crashed)
    torch.set_rng_state(states["rng"][mine].clone())
    if "cuda_rng" in states:
        torch.cuda.set_rng_state(states["cuda_rng"][mine].clone())


def plot(losses, reference, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, label="parallel")
    ax.plot(reference, "--", label="one process, dense")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm.py")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve: {path}")


if __name__ == "__main__":
    main()
