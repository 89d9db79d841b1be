"""Every torch internal tensorpar reads (tensorpar._torch) is where it is expected: an upgrade
that moves one fails here, by name, instead of taking a fallback silently."""

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch import nn

from tensorpar import _torch
from tensorpar.testing import run_distributed


def test_function_apply_internals():
    assert _torch.FUNCTORCH_ACTIVE is not None and _torch.FUNCTORCH_ACTIVE() is False
    x = torch.ones(2)
    assert _torch.UNWRAP_IF_DEAD is not None and _torch.UNWRAP_IF_DEAD(x) is x


def test_compile_and_subclass_internals():
    assert _torch.get_eval_frame_callback() is None  # not compiling
    assert callable(_torch.DISABLED_TORCH_FUNCTION)
    assert hasattr(_torch.C10D_FUNCTIONAL, "all_reduce")
    assert hasattr(_torch.C10D_FUNCTIONAL, "wait_tensor")
    assert _torch.tree_map(lambda t: t * 2, {"a": [torch.ones(1)]})["a"][0].item() == 2


def test_cpu_flash_attention_and_compiler_reset():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    out, lse = _torch.CPU_FLASH_ATTENTION(q, k, v, is_causal=True, scale=0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             scale=0.5)
    torch.testing.assert_close(out, dense)
    assert lse.shape == (1, 2, 5)
    grads = _torch.CPU_FLASH_ATTENTION_BACKWARD(torch.ones_like(out), q, k, v, out, lse, 0.0,
                                                True, scale=0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _torch.reset_compiler()


def test_optimizer_and_foreach_internals():
    hooks = _torch.global_optimizer_post_hooks()
    handle = torch_optimizer.register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert len(_torch.global_optimizer_post_hooks()) == len(hooks) + 1
    finally:
        handle.remove()
    fired = []
    pre = torch_optimizer.register_optimizer_step_pre_hook(lambda *a: fired.append("pre"))
    post = torch_optimizer.register_optimizer_step_post_hook(lambda *a: fired.append("post"))
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = torch.optim.SGD([p], lr=0.1)
    try:
        with _torch.global_optimizer_hooks_hidden():
            optimizer.step()
        assert fired == []
        optimizer.step()
        assert fired == ["pre", "post"]
    finally:
        pre.remove(), post.remove()
    assert _torch.foreach_supported(torch.device("cpu")) in (True, False)
    norms = _torch.foreach_norm([torch.tensor([3.0, 4.0]), torch.tensor([1.0])], 2.0)
    assert [n.item() for n in norms] == [5.0, 1.0]


def test_state_dict_post_hook():
    seen = []
    layer = nn.Linear(2, 2)
    _torch.register_state_dict_post_hook(layer, lambda m, state, prefix, local: seen.append(1))
    layer.state_dict()
    assert seen == [1]


def test_backward_pass_internals():
    assert _torch.current_graph_task_id() == -1
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad):
        seen.append(_torch.current_graph_task_id())
        _torch.queue_engine_callback(lambda: seen.append("after"))
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert seen[0] != -1 and seen[1:] == ["after"]


def test_saved_tensor_hooks_are_seen():
    from torch.utils.checkpoint import checkpoint

    assert not _torch.saved_tensors_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert _torch.saved_tensors_hooks_active()
    seen = []

    def fn(t):
        seen.append(_torch.saved_tensors_hooks_active())
        return t * t  # (saves t: recomputed in the backward)

    checkpoint(fn, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
    assert seen == [True, True]  # the forward and its recomputation


def test_post_accumulate_hooks_are_seen():
    w = nn.Parameter(torch.ones(2))
    assert not _torch.has_post_accumulate_hooks(w)
    handle = w.register_post_accumulate_grad_hook(lambda p: None)
    assert _torch.has_post_accumulate_hooks(w)
    handle.remove()
    assert not _torch.has_post_accumulate_hooks(w)


def test_a_captured_gradient_is_told_apart():
    w = nn.Parameter(torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(_torch.gradient_is_captured(w)))
    (w * x).sum().backward()
    torch.autograd.grad((w * x).sum(), [w])
    torch.autograd.grad((w * x).sum(), [x, w], create_graph=True)
    (w * x).sum().backward(inputs=[w])
    assert seen == [False, True, True, False]


def _distributed_internals():
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = _torch.C10D_WORLD
    assert hasattr(world, "pg_map") and hasattr(world, "pg_names")
    assert hasattr(world, "pg_coalesce_state")
    assert _torch.store_of(dist.group.WORLD) is not None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = distribute_tensor(torch.arange(10.0).view(5, 2), mesh, [Shard(0)])
    offsets = _torch.local_offsets(dt)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=mesh)
    managed = _torch.fsdp_managed_params(model)
    assert sorted(leaf for _, _, leaf in managed) == ["bias", "bias", "weight", "weight"]
    assert _torch.fsdp_managed_params(nn.Linear(2, 2)) == []
    return offsets


@pytest.mark.timeout(120)
def test_distributed_internals():
    assert run_distributed(_distributed_internals, 2, timeout=90) == [[0, 0], [3, 0]]


def test_an_unreadable_fsdp_layout_raises():
    class Moved(nn.Linear):
        def _get_fsdp_state(self):
            return object()  # a state without the parameter groups this torch has

    class Broken(nn.Linear):
        def _get_fsdp_state(self):
            state = type("State", (), {})()
            state._fsdp_param_groups = [object()]
            return state

    assert _torch.fsdp_managed_params(Moved(2, 2)) == []  # no groups: nothing managed
    with pytest.raises(RuntimeError, match="cannot read fully_shard's parameter layout"):
        _torch.fsdp_managed_params(Broken(2, 2))
