"""Tensor-parallel training and generation of a Hugging Face transformers model.

    torchrun --nproc-per-node 2 examples/hf_tensor_parallel.py

A small Llama with grouped-query attention and tied embeddings is built from its config on
every rank (the same seed), parallelised by the plan `plan_from_transformers` reads off the
model, trained for a few steps with the model's own loss (`labels=`), and then asked to
continue a prompt with `generate()`. The LM head is planned "gathered", so every rank sees the
full vocabulary, as `labels=` and `generate()` need. The check: one process training the dense
model on the same batches gives the same losses and the same generated text (the model runs
in float64 so that the comparison can be exact after any number of steps).
"""

import argparse
import pathlib
import sysconfig

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import tensorpar
from tensorpar.nn import plan_from_transformers

CONFIG = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                     max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0)



def text_bytes():
    """The source of one standard library module, as byte ids."""
    path = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    return torch.tensor(list(path.read_bytes()), dtype=torch.long)


def dense_model(device):
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).to(device, torch.float64)  # float64: an exact check


def train_and_generate(model, data, args, device):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - 65, (8,), generator=g).tolist()
        ids = torch.stack([data[s: s + 64] for s in starts]).to(device)
        loss = model(ids, labels=ids).loss                  # the model's own loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    prompt = torch.tensor([list(b"def wrap(text, width")], device=device)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    return losses, out[0]


def as_text(tokens):
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    device = tensorpar.init_distributed()  # survives torchrun --max-restarts
    rank = dist.get_rank()
    data = text_bytes()

    model = dense_model(device)
    plan = plan_from_transformers(model, lm_head="gathered")
    tensorpar.parallelize(model, plan)                      # group=None: every rank
    attn = model.model.layers[0].self_attn
    if rank == 0:
        print(f"q_proj holds {attn.q_proj.weight.shape[0] // 16} query heads and k_proj "
              f"{attn.k_proj.weight.shape[0] // 16} key/value heads on rank 0; tied: "
              f"{model.lm_head.weight is model.model.embed_tokens.weight}", flush=True)
    losses, tokens = train_and_generate(model, data, args, device)
    first = tensorpar.broadcast(tokens if rank == 0 else None, src=0)
    same = torch.tensor([int(torch.equal(first, tokens))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)             # every rank has rank 0's tokens

    if rank == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; generated: {as_text(tokens)!r}")
        ref_losses, ref_tokens = train_and_generate(dense_model(device), data, args, device)
        drift = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        ok = bool(same.item()) and torch.equal(tokens, ref_tokens) and drift < 1e-9
        print(f"check: every rank generated the same text, as one process with the dense model "
              f"does; losses within {drift:.1e} (< 1e-9): {'OK' if ok else 'FAILED'}",
              flush=True)
    else:
        ok = True
    verdict = torch.tensor([int(ok)], device=device)
    dist.broadcast(verdict, 0)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if verdict.item() else 1)


if __name__ == "__main__":
    main()
