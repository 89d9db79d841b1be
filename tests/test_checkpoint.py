"""Sharded checkpoints with torch.distributed.checkpoint: save at one TP size, load at another."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import tensorpar as tp
from tensorpar.nn import Colwise, Rowwise
from tensorpar.testing import run_distributed

VOCAB, DIM, HIDDEN = 101, 12, 50  # uneven at every TP size


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.lm_head(self.norm(x + self.down(torch.relu(self.up(x)))))


PLAN = {"embed": "vocab", "up": Colwise(), "down": Rowwise(), "lm_head": "colwise"}


def build(seed):
    torch.manual_seed(seed)
    return TiedLM().double()


def dense_state(model):
    """Every rank calls; rank 0 gets the dense tensors, the others None."""
    full = tp.full_state_dict(model)
    return {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None


def _save(path):
    model = tp.parallelize(build(1), PLAN)
    with torch.no_grad():  # weights no seed can reproduce, replicated ones alike on every rank
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i),
                               dtype=p.dtype))
    dcp.save(tp.sharded_state_dict(model), checkpoint_id=path)
    return dense_state(model)


def _load(path):
    model = tp.parallelize(build(2), PLAN)
    state = tp.sharded_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state)
    tied = model.lm_head.weight is model.embed.weight
    return dense_state(model), tied


def _load_dense(path):
    model = build(3)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("save_tp, load_tp", [(2, 3), (3, 2), (4, 1)])
def test_save_at_one_tp_size_load_at_another_and_into_the_dense_model(tmp_path, save_tp,
                                                                      load_tp):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, save_tp, path)[0]
    loaded, tied = run_distributed(_load, load_tp, path)[0]
    assert tied
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    dense = run_distributed(_load_dense, 1, path)[0]
    for key in saved:
        assert torch.equal(saved[key], dense[key]), key


def _direct(path):
    model = tp.parallelize(build(1), PLAN)
    try:
        dcp.save(model.state_dict(), checkpoint_id=path)
    except BaseException as e:  # DCP wraps every rank's error in a CheckpointException,
        return type(e).__name__, str(e)  # which derives from BaseException
    return None


def test_saving_model_state_dict_directly_raises_on_every_rank(tmp_path):
    results = run_distributed(_direct, 2, str(tmp_path / "direct"))
    for result in results:
        assert result is not None, "a parallel model's state_dict() was saved by DCP"
        assert "tensorpar.sharded_state_dict(model)" in result[1]
    assert not list((tmp_path / "direct").glob("*.metadata"))


def _plain_state_dict_still_works():
    model = tp.parallelize(build(1), PLAN)
    state = model.state_dict()
    copy = tp.parallelize(build(2), PLAN)
    copy.load_state_dict(state)  # an ordinary tensor everywhere but in DCP
    doubled = state["up.weight"] * 2
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                   copy.state_dict().values(), strict=True)), \
        tuple(doubled.shape)


def test_state_dict_shards_remain_ordinary_tensors():
    results = run_distributed(_plain_state_dict_still_works, 2)
    assert all(same for same, _ in results)
