"""Deliberate errors derive from TensorparError, and timeout messages name ranks in English."""

import pytest
import torch

import tensorpar as tp
from tensorpar.comm import _faults
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveTimeoutError, PeerLostError, TensorparError


@pytest.mark.parametrize("call", [
    lambda: tp.scatter(torch.ones(2), src=1),
    lambda: tp.gather(torch.ones(2), dst=-1),
    lambda: tp.broadcast(torch.ones(2), src=3),
    lambda: tp.reduce(torch.ones(2), dst=1),
])
def test_an_out_of_range_root_is_a_tensorpar_value_error(call):
    with pytest.raises(ValueError, match="is not a rank of the group") as info:
        call()
    assert isinstance(info.value, TensorparError)


@pytest.mark.parametrize("call", [
    lambda: tp.scatter(torch.ones(2), src=0.0),
    lambda: tp.all_gather(torch.ones(2), sizes=3),
    lambda: tp.all_gather(torch.ones(2), dim=1.5),
])
def test_a_root_or_sizes_of_the_wrong_type_is_a_tensorpar_type_error(call):
    with pytest.raises(TypeError) as info:
        call()
    assert isinstance(info.value, TensorparError)


@pytest.mark.parametrize(("missing", "words"), [([1], "rank 1 did not arrive"),
                                                ([0, 2], "ranks 0,2 did not arrive")])
def test_a_timeout_names_the_missing_ranks(monkeypatch, missing, words):
    monkeypatch.setattr(_faults, "_missing_ranks", lambda group, kind, seq: missing)
    with pytest.raises(CollectiveTimeoutError) as info:
        _faults.raise_translated(RuntimeError("Timed out waiting 2000ms for recv"),
                                 "all_reduce", Group(None, 1, 3), seq=4)
    assert words in str(info.value), str(info.value)
    assert "all_reduce #4 on a group of 3" in str(info.value)


def test_a_subgroups_ranks_are_named_with_their_global_ranks(monkeypatch):
    """``rank 1 went away`` on a subgroup meant its rank 1: the global rank comes with it."""
    monkeypatch.setattr(_faults, "_missing_ranks", lambda group, kind, seq: [1])
    monkeypatch.setattr(Group, "global_rank", lambda self, r: r + 2)
    with pytest.raises(PeerLostError) as info:
        _faults.raise_translated(RuntimeError("Connection reset by peer"), "all_reduce",
                                 Group(None, 0, 2), seq=4)
    assert "(this rank is 0 (global rank 2))" in str(info.value), str(info.value)
    assert "rank 1 (global rank 3) went away" in str(info.value), str(info.value)


def test_a_hierarchical_all_reduce_keeps_its_failed_collectives_error_class():
    """A stage's lost peer is a PeerLostError at wait(), whichever stage failed (a plain
    TensorparError wrapped it before, where a middle stage failed)."""
    from tensorpar.hierarchical import HierarchicalWork

    for error in (PeerLostError("all_reduce #3: rank 1 went away"),
                  CollectiveTimeoutError("all_reduce #3: timed out"), KeyError("other")):
        work = HierarchicalWork()
        work._error = error
        work._issued.set()
        with pytest.raises(TensorparError) as info:
            work.wait()
        assert type(info.value) is (type(error) if isinstance(error, TensorparError)
                                     else TensorparError)
        assert info.value.__cause__ is error
