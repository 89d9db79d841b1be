"""Tensor-parallel transformer block built from a dense model, checked against it.

    torchrun --nproc-per-node 3 examples/tensor_parallel.py

6 attention heads on 3 ranks (2 each), an MLP hidden size of 50 (17, 17, 16) and a
vocabulary of 101 (34, 34, 33): uneven shards, same numbers as the dense model.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import tensorpar
from tensorpar.nn import Colwise, Rowwise

VOCAB, DIM, HEAD_DIM, HIDDEN = 101, 24, 4, 50


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (rearrange(p(h), "b t (h d) -> b h t d", d=HEAD_DIM) for p in self.qkv)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(rearrange(a, "b h t d -> b t (h d)"))
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


PLAN = {"embed": "vocab", "block.qkv.*": Colwise(multiple_of=HEAD_DIM),
        "block.out": Rowwise(multiple_of=HEAD_DIM), "block.up": "colwise",
        "block.down": "rowwise", "head": "colwise"}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dense, model = TinyLM(), tensorpar.parallelize(TinyLM(), PLAN)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, model)]
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    target = ids.roll(-1, dims=1)
    for step in range(10):
        dense_loss = F.cross_entropy(dense(ids).flatten(0, 1), target.flatten())
        loss = tensorpar.nn.vocab_parallel_cross_entropy(model(ids).flatten(0, 1),
                                                         target.flatten())
        for value, opt in ((dense_loss, opts[0]), (loss, opts[1])):
            value.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0 and step % 3 == 0:
            print(f"step {step}: tensor-parallel loss {loss.item():.6f}, "
                  f"dense {dense_loss.item():.6f}")
    state = tensorpar.full_state_dict(model, dst=0)
    if rank == 0:
        same = all(torch.allclose(state[k], v, atol=1e-5) for k, v in dense.state_dict().items())
        print(f"dense checkpoint gathered on rank 0 matches the dense model: {same}")
    heads = model.block.qkv[0].shard.length // HEAD_DIM
    print(f"rank {rank}: {heads} heads, {model.block.up.shard.length} hidden units, "
          f"{model.head.shard.length} vocabulary rows")
    dist.barrier()  # every rank done communicating before any rank tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
