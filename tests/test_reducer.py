"""BucketedAllReduce against torch DDP, and its buckets, overlap, rebuild and errors."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorpar as tp
from tensorpar import BucketedAllReduce, CommCounter, ReducerError
from tensorpar.testing import run_distributed


class Tied(nn.Module):
    """An embedding whose weight is reused as the output projection."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.embed(x))))


class Branchy(nn.Module):
    """``branch`` runs on some ranks only; ``never`` runs on none."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 5)
        self.branch = nn.Linear(5, 5)
        self.never = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if dist.get_rank() % 2 == 0:
            h = h + self.branch(h)
        return self.head(h)


class Reversed(nn.Module):
    """Layers run in the reverse of their definition order."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 2)
        self.second = nn.Linear(4, 3)
        self.third = nn.Linear(5, 4)

    def forward(self, x):
        return self.first(torch.tanh(self.second(torch.tanh(self.third(x)))))


def make(name, dtype=torch.float64):
    torch.manual_seed(0)
    model = {
        "mlp": lambda: nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                     nn.Linear(16, 3)),
        "tied": Tied,
        "branchy": Branchy,
        "reversed": Reversed,
    }[name]()
    return model.to(dtype)


def batch(name, rank, step, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if name == "tied":
        return torch.randint(0, 11, (4, 3), generator=g)
    return torch.randn(4, 5, generator=g).to(dtype)


def _parity(name, options, steps, micro_batches, dtype_name, device="cpu"):
    """Train the same model with DDP and with BucketedAllReduce; return the largest gap."""
    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    ours = make(name, dtype).to(device)
    theirs = copy.deepcopy(ours)
    find_unused = options.get("find_unused_parameters", False)
    if options.get("algorithm"):  # machines of 2 ranks on 4 ranks, else one rank per machine
        from tensorpar.hierarchical.topology import Topology
        world = dist.get_world_size()
        options = {**options, "topology": Topology.grid(2 if world == 4 else 1)}
    wrapped = tp.nn.DistributedDataParallel(ours, **options)
    ddp = DDP(theirs, find_unused_parameters=find_unused,
              bucket_cap_mb=options.get("bucket_cap_mb", 25))
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    for step in range(steps):
        for model, opt in ((wrapped, opt_ours), (ddp, opt_theirs)):
            for m in range(micro_batches):
                x = batch(name, rank, step * 10 + m, dtype).to(device)
                last = m == micro_batches - 1
                with (model.no_sync() if not last else _nothing()):
                    model(x).float().pow(2).mean().backward()
            if model is wrapped:
                grads_none = [n for n, p in ours.named_parameters() if p.grad is None]
            opt.step()
            opt.zero_grad()
    gap = max((a.float() - b.float()).abs().max().item()
              for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))
    initial = next(make(name, dtype).parameters()).to(device)
    moved = (next(ours.parameters()).float() - initial.float()).abs().max().item()
    return gap, moved, grads_none


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


PARITY = [  # (model, options, micro-batches, dtype, tolerance)
    ("mlp", {}, 1, "float64", 1e-12),
    ("mlp", {"bucket_cap_mb": 0.0005, "first_bucket_mb": 0.0001}, 1, "float64", 1e-12),
    ("tied", {"bucket_cap_mb": 0.0005}, 1, "float64", 1e-12),
    ("branchy", {"find_unused_parameters": True, "bucket_cap_mb": 0.0003}, 1, "float64", 1e-12),
    ("mlp", {}, 3, "float64", 1e-12),                     # no_sync over 3 micro-batches
    ("branchy", {"find_unused_parameters": True}, 3, "float64", 1e-12),
    ("mlp", {"bucket_cap_mb": 0.0005}, 1, "bfloat16", 2e-2),
    # the same contract with the hierarchical all-reduce
    ("tied", {"bucket_cap_mb": 0.0005, "algorithm": "hierarchical"}, 1, "float64", 1e-12),
    ("branchy", {"find_unused_parameters": True, "bucket_cap_mb": 0.0003,
                 "algorithm": "hierarchical"}, 1, "float64", 1e-12),
    ("mlp", {"algorithm": "hierarchical"}, 3, "float64", 1e-12),
    ("mlp", {"bucket_cap_mb": 0.0005, "algorithm": "hierarchical"}, 1, "bfloat16", 2e-2),
    # several buckets in flight on a pool of process groups
    ("tied", {"bucket_cap_mb": 0.0005, "overlap_groups": 2}, 1, "float64", 1e-12),
    ("branchy", {"find_unused_parameters": True, "bucket_cap_mb": 0.0003,
                 "overlap_groups": 3}, 3, "float64", 1e-12),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name, options, micro, dtype, tol", PARITY,
                         ids=[f"{m}-{d}-{'x'.join(map(str, o.values())) or 'default'}-mb{k}"
                              for m, o, k, d, t in PARITY])
def test_parity_with_ddp(world_size, name, options, micro, dtype, tol):
    results = run_distributed(_parity, world_size, name, options, 4, micro, dtype, timeout=120)
    for gap, moved, grads_none in results:
        assert gap <= tol, results
        assert moved > 0  # training did change the weights
        if name == "branchy":
            # no rank ran `never`: its .grad stays None, as with DDP
            assert grads_none == ["never.weight", "never.bias"]


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = make("mlp")

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _checkpointed():
    rank = dist.get_rank()
    ours, theirs = Checkpointed(), Checkpointed()
    BucketedAllReduce(ours, bucket_cap_mb=0.0005)
    ddp = DDP(theirs)
    for model in (ours, ddp):
        model(batch("mlp", rank, 0)).pow(2).sum().backward()
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))


def test_non_reentrant_checkpointing_matches_ddp():
    assert run_distributed(_checkpointed, 2) == [0.0, 0.0]


def _reentrant_checkpoint_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 3)).double()
    BucketedAllReduce(model)

    def run(x):
        h = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=True)
        return model[1](h)

    try:
        run(batch("mlp", 0, 0).requires_grad_()).sum().backward()
    except ReducerError as e:
        return "use_reentrant=False" in str(e)
    return False


def test_reentrant_checkpointing_is_refused_with_a_clear_error():
    assert run_distributed(_reentrant_checkpoint_is_refused, 2) == [True, True]


# -- gradients are bucket views ------------------------------------------------------------

def _storage_shared():
    model = make("reversed")
    reducer = BucketedAllReduce(model, bucket_cap_mb=0.0001, first_bucket_mb=0.00001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers = {}

    def all_views():
        buffers.clear()
        for b in reducer.buckets:
            for name in b.param_names:
                buffers[name] = b.buffer.untyped_storage().data_ptr()
        return all(p.grad is not None and
                   p.grad.untyped_storage().data_ptr() == buffers[n]
                   for n, p in model.named_parameters())

    results = []
    before = [b.param_names for b in reducer.buckets]
    for step in range(3):
        model(batch("mlp", dist.get_rank(), step)).sum().backward()
        results.append(all_views())          # step 0: after the rebuild; later: steady state
        opt.step()
        opt.zero_grad(set_to_none=True)     # the next backward allocates fresh grads
    after = [b.param_names for b in reducer.buckets]
    return results, before, after


def test_grads_are_bucket_views_across_rebuild_and_set_to_none():
    results = run_distributed(_storage_shared, 2)
    for views, before, after in results:
        assert views == [True, True, True]
        # built in reverse definition order, rebuilt in the order grads became ready
        layers = [name.split(".")[0] for names in before for name in names]
        assert layers == ["third"] * 2 + ["second"] * 2 + ["first"] * 2  # definition, reversed
        layers = [name.split(".")[0] for names in after for name in names]
        assert layers == ["first"] * 2 + ["second"] * 2 + ["third"] * 2  # execution order


def _launch_during_backward():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).double()
    reducer = BucketedAllReduce(model, bucket_cap_mb=0.02, first_bucket_mb=0.02)
    seen = {}

    def before_last_grad(grad):  # the first layer's weight gets its gradient last
        seen["launched"] = sum(b.launched for b in reducer.buckets)

    model[0].weight.register_hook(before_last_grad)  # runs before the grad is accumulated
    with CommCounter() as counter:
        model(torch.randn(8, 64, dtype=torch.float64)).sum().backward()
    return seen["launched"], len(reducer.buckets), counter.count("all_reduce")


def test_buckets_launch_while_backward_still_runs():
    for launched, total, reduces in run_distributed(_launch_during_backward, 2):
        assert total >= 6 and 0 < launched < total
        assert reduces == total  # one all-reduce per bucket


def _counters_and_dtypes(compress):
    model = make("mlp")
    options = {"compress_dtype": torch.bfloat16} if compress else {}
    model = model.float()
    reducer = BucketedAllReduce(model, **options)
    model(batch("mlp", dist.get_rank(), 0).float()).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return (reducer.bytes_reduced, sum(b.nbytes for b in reducer.buckets),
            reducer.sync_wait_seconds >= 0, reducer.iterations, grads)


def test_counters_and_compression():
    plain = run_distributed(_counters_and_dtypes, 2, False)
    packed = run_distributed(_counters_and_dtypes, 2, True)
    assert plain[0][0] == plain[0][1] and plain[0][3] == 1
    assert packed[0][0] * 2 == packed[0][1]  # bf16 on the wire: half the bytes
    torch.testing.assert_close(packed[0][4], plain[0][4], rtol=1e-2, atol=1e-2)
    assert not torch.equal(packed[0][4], plain[0][4])  # it really went through bf16


def _reduce_dtype(reduce_dtype):
    """Sum bf16 gradients of 4 ranks; return the result and the exactly rounded sum."""
    rank, p = dist.get_rank(), dist.get_world_size()

    def grad_of(r):  # rank r's gradient: its input, in bf16
        g = torch.Generator().manual_seed(r)
        return (torch.rand(1, 256, generator=g) * 100).to(torch.bfloat16)

    model = nn.Linear(256, 1, bias=False).to(torch.bfloat16)
    options = {"reduce_dtype": reduce_dtype} if reduce_dtype else {}
    reducer = BucketedAllReduce(model, average=False, **options)
    model(grad_of(rank)).sum().backward()
    exact = sum(grad_of(r).double() for r in range(p)).to(torch.bfloat16)
    return reducer.buckets[0].comm_dtype, torch.equal(model.weight.grad, exact)


def test_reduce_dtype_float32_for_bf16():
    # float32 sums 4 bf16 values exactly, then rounds once: the exactly rounded result
    assert run_distributed(_reduce_dtype, 4, torch.float32)[0] == (torch.float32, True)
    # summing in bf16 rounds at every step and misses it (the reason for reduce_dtype)
    assert run_distributed(_reduce_dtype, 4, None)[0] == (torch.bfloat16, False)


def _single_rank():
    model = make("mlp")
    with CommCounter() as counter:
        reducer = BucketedAllReduce(model)
        model(batch("mlp", 0, 0)).sum().backward()
    return counter.count(), reducer.buckets, all(p.grad is not None for p in model.parameters())


def test_group_of_one_issues_no_collective():
    assert run_distributed(_single_rank, 1) == [(0, [], True)]


def _on_subgroup():
    """A data-parallel group next to another group: only its members reduce together."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = nn.Linear(2, 1, bias=False).double()
    BucketedAllReduce(model, group=groups[rank % 2])
    model(torch.full((1, 2), float(rank), dtype=torch.float64)).sum().backward()
    return model.weight.grad[0, 0].item()


def test_reduces_within_a_subgroup():
    assert run_distributed(_on_subgroup, 4) == [1.0, 2.0, 1.0, 2.0]


def _pool_on_subgroup():
    """overlap_groups on a subgroup: only its members create the pool's groups."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)).double()
    reducer = BucketedAllReduce(model, group=groups[rank % 2], overlap_groups=3,
                                bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
    for _ in range(2):  # before and after the rebuild in execution order
        model.zero_grad()
        model(torch.full((1, 2), float(rank), dtype=torch.float64)).sum().backward()
    sizes = [g.size for g in reducer._pool.groups]
    grads = [p.grad.tolist() for p in model.parameters()]  # plain values: fresh ranks exit
    reducer.remove()
    return sizes, len(reducer.buckets), len(reducer._pool), grads


@pytest.mark.slow
def test_overlap_groups_pool_on_a_subgroup_and_its_removal():
    # fresh ranks: group names derive from how many groups each process has made, which the
    # pooled ranks' earlier tests leave different (the pool then keeps one group, as designed)
    from tests._fresh_ranks import run_fresh

    replies = run_fresh(_pool_on_subgroup, 4, pg_timeout=30.0, timeout=60.0)
    assert all(r is not None and r[0] == "ok" for r in replies), replies
    results = [r[1] for r in replies]
    for rank, (sizes, buckets, after_remove, grads) in enumerate(results):
        assert sizes == [2, 2, 2] and buckets >= 3 and after_remove == 1  # buckets > groups
        partner = results[(rank + 2) % 4][3]  # the other member of this rank's subgroup
        assert grads == partner  # bit for bit: float64 values compare exactly


def _bad_overlap(value):
    try:
        BucketedAllReduce(nn.Linear(2, 2), overlap_groups=value)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_overlap_groups_must_be_a_positive_int(value):
    assert "overlap_groups" in run_distributed(_bad_overlap, 2, value)[0]


# -- errors: each raised on every rank, none hangs ------------------------------------------

def _error(case):
    with tp.validation(case == "unused, validation"):
        return _error_in(case)


def _error_in(case):
    rank = dist.get_rank()
    model = make("branchy" if case.startswith("unused") else "mlp")
    if case == "models differ" and rank == 1:
        model[2] = nn.Linear(16, 17)
    try:
        reducer = BucketedAllReduce(model)
        x = batch("mlp", rank, 0)
        if case == "grad twice":  # a second gradient for one parameter in one backward
            index = reducer._names.index("0.bias")
            model[0].bias.register_post_accumulate_grad_hook(
                lambda p: reducer._on_grad_ready(index, p))
        if case == "added":
            model.add_module("extra", nn.Linear(2, 2))
        if case == "frozen":
            model[0].bias.requires_grad_(False)
        if case == "grad replaced":
            def swap(p):
                p.grad = p.grad.clone()
            model[0].bias.register_post_accumulate_grad_hook(swap)
        if case == "interrupted":  # a nested backward inside the reducer's backward pass
            def nested(p):
                if p.grad is not None and not getattr(nested, "ran", False):
                    nested.ran = True
                    with torch.enable_grad():
                        model(x).sum().backward()
            model[2].weight.register_post_accumulate_grad_hook(nested)
        model(x).sum().backward()
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = None
    # no rank hangs, and the group still works
    assert tp.all_reduce(torch.ones(1)).item() == dist.get_world_size()
    return outcome


@pytest.mark.parametrize("case, match", [
    ("models differ", r"parameter #2 is '2.weight float64\[16, 16\]' on rank 0 but "
                      r"'2.weight float32\[17, 16\]' on rank 1"),
    # validation mode exchanges which rank used what: every rank names every rank's
    ("unused, validation", r"'branch.weight' \(no gradient on ranks \[1\]\).*'never.weight' "
                           r"\(no gradient on ranks \[0, 1\]\).*find_unused_parameters=True"),
    # otherwise nothing is exchanged: each rank names its own (here both ranks skip one)
    ("unused", r"on rank \d: \[('branch.weight', 'branch.bias', )?'never.weight', "
               r"'never.bias'\]\. Pass find_unused_parameters=True"),
    ("added", r"parameter 'extra.weight' was added"),
    ("frozen", r"parameter '0.bias' had requires_grad=True .* now False"),
    ("grad replaced", r"the .grad of \['0.bias'\] was replaced"),
    ("interrupted", r"a new backward pass started before the previous one finished"),
    ("grad twice", r"\['0.bias'\] received a gradient twice in one backward pass"),
])
def test_errors_name_the_problem_on_every_rank(case, match):
    outcomes = run_distributed(_error, 2, case)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == "ReducerError", outcomes
        assert re.search(match, outcome[1]), outcome[1]


def test_bad_options():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedAllReduce(nn.Linear(1, 1), bucket_cap_mb=0)


def _freed_with_the_model():
    import gc
    import weakref

    model = make("mlp")
    BucketedAllReduce(model)  # not kept: the model owns it
    model(batch("mlp", dist.get_rank(), 0)).sum().backward()  # still reduces
    averaged = all(p.grad is not None for p in model.parameters())
    alive = weakref.ref(model)
    del model
    gc.collect()
    return averaged, alive() is None


def test_reducer_lives_and_dies_with_its_model():
    assert run_distributed(_freed_with_the_model, 2) == [(True, True)] * 2


def _buffers_like_ddp(broadcast):
    """BatchNorm's running statistics follow rank 0's, as with DDP(broadcast_buffers=True)."""
    rank = dist.get_rank()

    def bn_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(),
                             nn.Linear(6, 2)).double()

    ours, theirs = bn_model(), bn_model()
    BucketedAllReduce(ours, broadcast_buffers=broadcast)
    ddp = DDP(theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        x = batch("mlp", rank, step) * (rank + 1)  # ranks see different statistics
        for model, opt in zip((ours, ddp), opts, strict=True):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    states = [m.state_dict() for m in (ours, theirs)]
    return max((states[0][k].double() - states[1][k].double()).abs().max().item()
               for k in states[0])


def test_buffers_are_broadcast_like_ddp():
    assert all(gap <= 1e-12 for gap in run_distributed(_buffers_like_ddp, 3, True))
    gaps = run_distributed(_buffers_like_ddp, 3, False)  # without it, ranks 1 and 2 drift
    assert gaps[1] > 1e-3 and gaps[2] > 1e-3
