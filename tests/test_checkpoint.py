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


@pytest.mark.timeout(900)
@pytest.mark.parametrize("save_tp, load_tp", [(2, 3), (3, 2), (4, 1)])
def test_save_at_one_tp_size_load_at_another_and_into_the_dense_model(tmp_path, save_tp,
                                                                      load_tp):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, save_tp, path, timeout=180)[0]
    loaded, tied = run_distributed(_load, load_tp, path, timeout=180)[0]
    assert tied
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    dense = run_distributed(_load_dense, 1, path, timeout=180)[0]
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


class PackedConvModel(nn.Module):
    """A fused [q; k; v] (GQA units, packed split) and a GPT-2 style Conv1D MLP."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.qkv = nn.Linear(DIM, 24 + 6 + 6)             # 12 q heads, 3 kv heads, head_dim 2
        self.gate_up = nn.Linear(DIM, 2 * 25, bias=False)  # [gate; up], 25 each
        self.c_fc = Conv1D(HIDDEN, DIM)
        self.c_proj = Conv1D(DIM, HIDDEN)


PACKED_PLAN = {"qkv": tp.nn.PackedColwise(blocks=(24, 6, 6), multiple_of=(8, 2, 2)),
               "gate_up": tp.nn.PackedColwise(blocks=2), "c_fc": "colwise", "c_proj": "rowwise"}


def build_packed(seed):
    torch.manual_seed(seed)
    return PackedConvModel().double()


def _save_packed(path):
    model = tp.parallelize(build_packed(1), PACKED_PLAN)
    dcp.save(tp.sharded_state_dict(model), checkpoint_id=path)
    return dense_state(model)


def _load_packed(path):
    model = tp.parallelize(build_packed(2), PACKED_PLAN)
    state = tp.sharded_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    tp.load_sharded_state_dict(model, state)
    return dense_state(model)


def _load_packed_dense(path):
    model = build_packed(3)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return {k: v.clone() for k, v in model.state_dict().items()}, build_packed(1).state_dict()


def test_packed_and_conv1d_layers_save_at_tp2_load_at_tp3_and_dense(tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "packed")
    saved = run_distributed(_save_packed, 2, path)[0]
    loaded = run_distributed(_load_packed, 3, path)[0]
    dense, original = run_distributed(_load_packed_dense, 1, path)[0]
    assert saved.keys() == loaded.keys() == dense.keys() == original.keys()
    for key in saved:  # the dense, unpermuted layout everywhere (Conv1D's (in, out) included)
        assert torch.equal(saved[key], original[key]), key
        assert torch.equal(loaded[key], original[key]), key
        assert torch.equal(dense[key], original[key]), key


def _packed_shard_chunks():
    model = tp.parallelize(build_packed(1), PACKED_PLAN)
    state = tp.sharded_state_dict(model)
    qkv = state["qkv.weight"]
    return [c.offsets[0] for c in qkv.__create_chunk_list__()], tuple(qkv.size())


def test_a_packed_shard_is_one_checkpoint_chunk_per_block():
    results = run_distributed(_packed_shard_chunks, 2)
    # q: 3 units of 8 -> 16, 8; k and v: 3 units of 2 -> 4, 2
    assert results[0] == ([0, 24, 30], (36, DIM))
    assert results[1] == ([16, 28, 34], (36, DIM))


def _full_state_is_a_copy():
    """Every tensor of `full_state_dict` on the destination is a copy: writing to it leaves
    the model as it was, at every group size (at size 1 the gathered shards were the model's
    own parameters, at size 2 copies)."""
    model = tp.parallelize(build(1), PLAN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = tp.full_state_dict(model)
    if dist.get_rank() == 0:
        for value in full.values():
            value.mul_(0).add_(7)
    return [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_the_full_state_dict_shares_no_storage_with_the_model(world):
    changed = run_distributed(_full_state_is_a_copy, world, timeout=60)[0]
    assert changed == [], changed
