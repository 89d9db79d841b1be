"""A model that lists its own pipeline blocks (``pipeline_blocks()``): an embedding with a
position parameter of the model's own, blocks, a norm and a head tied to the embedding."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.errors import CollectiveTypeError
from tensorpar.testing import run_distributed

TOL = 1e-10
VOCAB, DIM, LENGTH = 11, 6, 5


class TinyLM(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(LENGTH, DIM))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def embed_positions(self, ids):
        return self.embed(ids) + self.pos[: ids.shape[1]]

    def logits(self, x):
        return self.head(self.norm(x))

    def forward(self, ids):
        x = self.embed_positions(ids)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def pipeline_blocks(self):
        return [(("embed", "pos"), self.embed_positions),
                *(((f"blocks.{i}",), b) for i, b in enumerate(self.blocks)),
                (("norm", "head"), self.logits)]


def token_loss(logits, target):  # mean over the microbatch's tokens
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _own_blocks_match_dense(schedule, virtual):
    dense = TinyLM()
    pipe = tp.nn.pipeline(TinyLM(), microbatches=3, schedule=schedule, loss_fn=token_loss,
                          virtual_stages=virtual)
    g = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, VOCAB, (7, LENGTH), generator=g) for _ in range(2))
    loss = pipe.step(ids if pipe.is_first else None, target if pipe.is_last else None)
    dense_loss = token_loss(dense(ids), target)
    dense_loss.backward()
    if pipe.is_last:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=TOL, atol=TOL)
    grads = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL, msg=name)
    torch.testing.assert_close(tp.nn.grad_norm(pipe), torch.nn.utils.get_total_norm(
        [p.grad for p in dense.parameters()]), rtol=TOL, atol=TOL)
    return [name for name, _ in pipe.named_parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)])
def test_own_blocks_equal_dense(schedule, virtual, world_size):
    if virtual * world_size > 6:
        pytest.skip("6 blocks fill at most 6 stages")
    results = run_distributed(_own_blocks_match_dense, world_size, schedule, virtual,
                              timeout=100)
    assert {"embed.weight", "pos"} <= set(results[0])
    last = results[(world_size * virtual - 1) % world_size]
    assert {"norm.weight", "head.weight"} <= set(last)
    assert "pos" not in last and "head.weight" not in results[0]


def test_own_blocks_single_process_keep_every_name():
    names = _own_blocks_match_dense("1f1b", 2)
    assert names == [n for n, _ in TinyLM().named_parameters()]


def test_bad_blocks_name_the_item():
    model = TinyLM()
    model.pipeline_blocks = lambda: [(("embed", "nope"), model.embed_positions)]
    with pytest.raises(CollectiveTypeError, match=r"pipeline_blocks\(\) item 0"):
        tp.nn.pipeline(model, microbatches=2, loss_fn=token_loss)
