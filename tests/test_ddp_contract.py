"""tensorpar.nn.DistributedDataParallel takes DDP's arguments and runs torch's own comm hooks."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tensorpar as tp
from tensorpar.testing import run_distributed


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)


def train_script(ddp_class, steps=3):
    """A DDP training script: only the class differs between the two runs."""
    net = ddp_class(model(), device_ids=None, output_device=None, dim=0,
                    broadcast_buffers=True, init_sync=True, process_group=None,
                    bucket_cap_mb=25, find_unused_parameters=False, check_reduction=False,
                    gradient_as_bucket_view=True, static_graph=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        with net.no_sync():
            F.mse_loss(net(x), y).backward()
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.module.parameters()]


def _script_runs_unchanged():
    ours = train_script(tp.nn.DistributedDataParallel)
    theirs = train_script(TorchDDP)
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def test_a_ddp_script_runs_unchanged_with_the_import_swapped():
    assert max(run_distributed(_script_runs_unchanged, 2)) < 1e-6


STATE_FOR = {"allreduce": lambda: None, "fp16": lambda: None,
             "powersgd": lambda: powerSGD_hook.PowerSGDState(
                 process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                 use_error_feedback=True, warm_start=True, random_seed=0)}
HOOKS = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "powersgd": powerSGD_hook.powerSGD_hook}


def _hook_gradients(name):
    net = model()
    ours = tp.nn.DistributedDataParallel(net)
    theirs = TorchDDP(copy.deepcopy(net))
    ours.register_comm_hook(STATE_FOR[name](), HOOKS[name])
    theirs.register_comm_hook(STATE_FOR[name](), HOOKS[name])
    gaps = []
    for step in range(4):  # PowerSGD starts compressing at step 2
        x, y = batch(step)
        for wrapped in (ours, theirs):
            wrapped.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
        gaps.append(max((a.grad - b.grad).abs().max().item() for a, b in
                        zip(ours.module.parameters(), theirs.module.parameters(), strict=True)))
    return gaps, [p.grad.clone() for p in ours.module.parameters()]


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_torch_comm_hooks_give_ddps_gradients(name):
    results = run_distributed(_hook_gradients, 2, name)
    for gaps, _ in results:
        assert max(gaps) < 1e-6, gaps
    for a, b in zip(results[0][1], results[1][1], strict=True):  # the same on every rank
        assert torch.equal(a, b)


def _powersgd_many_buckets():
    net = model()
    ours = tp.nn.DistributedDataParallel(net, bucket_cap_mb=1e-5)  # a bucket per parameter
    ours.register_comm_hook(STATE_FOR["powersgd"](), HOOKS["powersgd"])
    plain = copy.deepcopy(net)
    gaps = []
    for step in range(4):
        x, y = batch(step)
        ours.zero_grad()
        F.mse_loss(ours(x), y).backward()
        plain.zero_grad()
        F.mse_loss(plain(x), y).backward()
        exact = []
        for p in plain.parameters():  # the exact average, for comparison
            dist.all_reduce(p.grad)
            exact.append(p.grad / dist.get_world_size())
        gaps.append(max((a.grad - b).abs().max().item()
                        for a, b in zip(ours.module.parameters(), exact, strict=True)))
    return len(ours.reducer.buckets), gaps, [p.grad.clone() for p in ours.module.parameters()]


def test_powersgd_with_many_buckets_in_flight():
    # PowerSGD issues collectives from its futures' callbacks and waits inside one: with
    # several hooks in flight they deadlock on gloo's worker threads, or pair in different
    # orders on different ranks (torch's DDP deadlocks on this very case). tensorpar runs
    # one hook at a time.
    results = run_distributed(_powersgd_many_buckets, 2, timeout=60)
    for buckets, gaps, _ in results:
        assert buckets == 6
        assert max(gaps[:2]) < 1e-6, gaps  # plain all-reduce before start_powerSGD_iter=2
        assert min(gaps[2:]) > 1e-4, gaps  # compressed from then on: rank-1 approximations
    for a, b in zip(results[0][2], results[1][2], strict=True):  # the same on every rank
        assert torch.equal(a, b)


def _bf16_hook():
    """On gloo, which sums bfloat16, tensorpar runs the hook DDP refuses there."""
    wrapped = tp.nn.DistributedDataParallel(model())
    wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    plain = model()
    x, y = batch(0)
    F.mse_loss(wrapped(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    gaps = []
    for ours, local in zip(wrapped.module.parameters(), plain.parameters(), strict=True):
        every = [torch.empty_like(local.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(every, local.grad)
        # the hook's arithmetic: cast to bfloat16, divide, sum in bfloat16, cast back
        parts = [g.to(torch.bfloat16).div_(len(every)) for g in every]
        expected = torch.stack(parts).sum(0, dtype=torch.bfloat16).to(local.dtype)
        gaps.append((ours.grad - expected).abs().max().item())
    try:
        TorchDDP(model()).register_comm_hook(None, default_hooks.bf16_compress_hook)
        refused = None
    except TypeError as e:
        refused = str(e)
    return max(gaps), refused


def test_bf16_hook_runs_where_the_backend_sums_bfloat16():
    for gap, torch_refusal in run_distributed(_bf16_hook, 2):
        assert gap == 0.0
        assert torch_refusal is not None and "NCCL" in torch_refusal  # DDP refuses on gloo


def _refusals():
    net = model()
    outcomes = []
    for kwargs in ({"mixed_precision": object()}, {"device_ids": [0, 1]}, {"dim": 1},
                   {"bucket_cap_mb": -1}):
        try:
            tp.nn.DistributedDataParallel(net, **kwargs)
        except (TypeError, ValueError) as e:
            outcomes.append(str(e))
    wrapped = tp.nn.DistributedDataParallel(net)
    wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    except tp.ReducerError as e:
        outcomes.append(str(e))
    return outcomes


def test_unsupported_arguments_are_refused_naming_the_class():
    outcomes = run_distributed(_refusals, 2)[0]
    assert len(outcomes) == 5
    assert all(o.startswith("DistributedDataParallel") for o in outcomes[:4]), outcomes
    assert "already registered" in outcomes[4]

