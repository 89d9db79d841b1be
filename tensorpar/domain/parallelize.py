"""`parallelize_domain`: a dense convolutional model made domain-parallel, in place."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from tensorpar._torch import gradient_is_captured, queue_engine_callback
from tensorpar.comm._compiling import FORCE_EAGER, force_eager
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.ddp._partial_sums import register_partial_sums
from tensorpar.domain._forward import calls
from tensorpar.domain._forward.flow import refuse_checkpointed
from tensorpar.domain._forward.following import refuse_unless_image
from tensorpar.domain._forward.meet import ambiguous_spread, runs_dense
from tensorpar.domain._layers import (
    attention,
    monai,
    neuralop,
    norms,
    resample,
    shuffle,
    window,
)
from tensorpar.domain._tiles.agree import over_groups
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import POOLED, TILE
from tensorpar.validation.calls import agreed, structure

__all__ = ["domain_context", "domain_layout", "parallelize_domain"]

_CTX = "_tensorpar_domain"

Forward = Callable[[Any, DomainContext, torch.Tensor], torch.Tensor]

_CONVERT: list[tuple[tuple[type, ...], Forward]] = [
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), window.conv_forward),
    ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
     resample.conv_transpose_forward),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
     window.pool_forward),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), resample.global_pool_forward),
    ((nn.Upsample,), resample.upsample_forward),
    ((nn.PixelShuffle, nn.PixelUnshuffle), shuffle.shuffle_forward),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
     norms.batch_norm_forward),
    ((nn.GroupNorm,), norms.group_norm_forward),
    ((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d), norms.instance_norm_forward),
    ((nn.LayerNorm,), norms.layer_norm_forward),
]

_NORMS = frozenset({norms.batch_norm_forward, norms.group_norm_forward,
                    norms.instance_norm_forward, norms.layer_norm_forward})
"""The norms' forwards: they read a reshaped tile's points themselves (`norms._reshaped`)."""

_POINTWISE: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Threshold, nn.LogSigmoid, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Linear,
    nn.Embedding, nn.Flatten,
)
"""Leaf layers that act on each point (or on replicated data) and run as they are."""

_PADS: tuple[type, ...] = (
    nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d,
    nn.ZeroPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d, nn.CircularPad1d,
    nn.CircularPad2d, nn.CircularPad3d,
)
"""Padding layers: they call ``F.pad``, which a converted model's forward converts."""

_KNOWN_POINTWISE = frozenset({
    "diffusers.models.embeddings.Timesteps",  # sinusoidal embedding of the timestep
    "neuralop.layers.skip_connections.SoftGating",  # a per-channel weight (and bias)
    "monai.networks.blocks.activation.Swish",  # MONAI's activations
    "monai.networks.blocks.activation.MemoryEfficientSwish",
    "monai.networks.blocks.activation.Mish",
    "monai.networks.nets.autoencoderkl.AsymmetricPad",  # calls F.pad (converted)
    "monai.networks.layers.simplelayers.ChannelPad",  # pads channels (or a 1x1 conv child)
})
"""Leaf layers of other libraries, by qualified class name, that never see the image."""


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__name__}"


def _forward_for(module: nn.Module) -> tuple[Forward, tuple[str, ...]] | None:
    """The layer's domain-parallel forward and the keywords it accepts when ``None``."""
    for types_, fwd in _CONVERT:
        if isinstance(module, types_):
            base: Any = next(t for t in type(module).__mro__ if t in types_)
            if type(module).forward is base.forward:
                return fwd, ()
    return neuralop.CONVERT.get(_qualname(module))


def _inside_converted(model: nn.Module) -> set[int]:
    """The modules that need no conversion of their own.

    Those inside a converted layer (they run as part of its forward), and the
    parametrizations' (``weight_norm``, ``spectral_norm``: they make a weight from
    parameters and never see the image).
    """
    return {id(d) for m in model.modules()
            if _forward_for(m) is not None or isinstance(m, parametrize.ParametrizationList)
            for d in m.modules() if d is not m}


def _refusal(name: str, module: nn.Module, keep: Sequence[type | str],
             dims: tuple[int, ...]) -> str | None:
    """Why ``module`` cannot be converted (``None``: it can, or it needs nothing)."""
    label = f"{name or '<model>'} ({type(module).__name__})"
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return f"{label}: its parameters are not initialised yet (a lazy layer): run one " \
               f"forward of the dense model first"
    why = neuralop.refusal(module, _qualname(module), dims) \
        or attention.refusal(module, _qualname(module)) \
        or monai.refusal(module, _qualname(module))
    if why is not None:
        return f"{label}: {why}"
    fwd = _forward_for(module)
    if fwd is None:
        if isinstance(module, (*_POINTWISE, *_PADS)) \
                or next(module.children(), None) is not None \
                or isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) \
                or _qualname(module) in _KNOWN_POINTWISE \
                or any(k == name or k == type(module).__name__ if isinstance(k, str)
                       else isinstance(module, k) for k in keep):
            return None
        return f"{label}: no domain-parallel version of this layer (if it never sees the " \
               f"image or acts on each point, name it in pointwise=)"
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)) and module.return_indices:
        return f"{label}: return_indices=True (the indices would be the tile's)"
    if isinstance(module, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)) \
            and module.return_indices:
        return f"{label}: return_indices=True (the indices would be the tile's)"
    if isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                           nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
        size = module.output_size
        sizes = size if isinstance(size, (tuple, list)) else (size,)
        if any(s != 1 for s in sizes):
            return f"{label}: output_size={size} (only global pooling, output size 1)"
    if isinstance(module, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)) \
            and module.track_running_stats:
        return f"{label}: track_running_stats=True"
    if isinstance(module, nn.Upsample) and module.mode not in resample.MODES:
        return f"{label}: mode={module.mode!r} (supported: {', '.join(resample.MODES)})"
    return None


def parallelize_domain(model: nn.Module, *, dims: int | Sequence[int],
                       group: GroupLike = None, pointwise: Sequence[type | str] = (),
                       double_backward: bool = False
                       ) -> nn.Module:
    """Make a dense convolutional model domain-parallel, in place.

    Each rank calls the converted model with its own tile of the image input (the dense
    tensor split along ``dims`` in rank order; any sizes, including a tile narrower than a
    halo and an empty tile) and gets its tile of the dense output, or the whole output
    where no split dim is left (after a global pooling). Every parameter's gradient after
    backward is the dense gradient, and each input tile's gradient its slice of the dense
    one. Parameter and buffer names are unchanged: the layers keep their class and weights;
    each converted layer's ``forward`` is replaced.

    Converted: ``Conv1d/2d/3d`` (any kernel, stride, dilation, groups, padding ints,
    ``"same"``, ``"valid"``; padding modes zeros, circular, reflect, replicate),
    ``ConvTranspose1d/2d/3d``, ``MaxPool``/``AvgPool`` (with padding), ``AdaptiveAvgPool``
    and ``AdaptiveMaxPool`` to size 1, ``Upsample`` (nearest; linear/bilinear/trilinear),
    ``PixelShuffle`` and ``PixelUnshuffle`` (split along H or W), ``BatchNorm``,
    ``GroupNorm``, ``InstanceNorm``, ``LayerNorm``; diffusers' and MONAI's spatial
    self-attention (``Attention``, ``SpatialAttentionBlock``: ring attention over the
    domain's points); MONAI's ``SubpixelUpsample``; neuraloperator's 2-D ``SpectralConv``
    split along H (a distributed real FFT, `distributed_rfft2_apply`) and grid embeddings.
    Pointwise layers run as they are. Any other leaf layer, and the neuraloperator options
    that cannot be converted (``domain_padding``, ``complex_data``, resampling), are
    refused, on every rank, before anything changes. ``F.interpolate``, ``F.pad`` (also
    through the padding layers), ``F.pixel_shuffle``, ``F.pixel_unshuffle``,
    ``F.conv1d/2d/3d``, ``F.max_pool``/``F.avg_pool``, ``F.adaptive_avg_pool`` and
    ``F.adaptive_max_pool`` to size 1, and a ``sum``, ``mean``, ``amax`` or ``amin`` over
    every split dim called inside a forward are converted while the model runs;
    ``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``, and a softmax, sort or
    other reduction along a split dim raise on tensors derived from the tile; other
    functional calls are not converted (see the domain parallelism guide).
    Pooled features may go back into the tiles (squeeze-and-excitation).

    The first tensor argument of the model's forward is the image input; other arguments
    (a timestep) pass through. Every tile's size along each split dim is exchanged once per
    forward at the entry (one small all-gather per split dim); see `domain_layout`.

    Args:
        model: the dense model; converted in place.
        dims: the split dims of the image input: an int or a tuple (negative count from the
            end: ``-2`` is H of NCHW, ``-3`` is D of NCDHW; positive from the front).
        group: the process group for one split dim (``None``: the default group, resolved
            now), or a ``DeviceMesh`` with one mesh dim per entry of ``dims`` (a grid of
            tiles: mesh dim ``i`` splits ``dims[i]``).
        pointwise: more leaf layers to run as they are (types, class names or module
            names): layers that act on each point or never see the image. Built in: torch's
            activations, dropout, ``Linear``, ``Embedding``, ``Flatten``, diffusers'
            ``Timesteps``, neuraloperator's ``SoftGating`` and MONAI's ``Swish``,
            ``MemoryEfficientSwish``, ``Mish``, ``ChannelPad`` and ``AsymmetricPad``.
        double_backward: keep every layer differentiable any number of times (a gradient
            penalty, a physics-informed loss on input derivatives). Default ``False``:
            convolutions on strips compute while their halo travels and the norms run
            torch's kernel with one exchange each way; those are differentiable once.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: bad ``dims``, a mesh whose number of dims differs from ``dims``, an
            already converted model, or layers that cannot be converted (all named).
        TypeError: ``dims`` is not an int or a sequence of ints.
        CollectiveArgumentError: (at a forward, on every rank) the ranks' tiles differ in
            a dim their group does not split, in dtype or in train/eval mode.

    Example:
        >>> import torch
        >>> net = parallelize_domain(torch.nn.Conv2d(1, 1, 3, padding=1), dims=-2)
        >>> net(torch.ones(1, 1, 4, 4)).shape  # one rank: its tile is the whole image
        torch.Size([1, 1, 4, 4])
    """
    fn = "parallelize_domain"
    if not isinstance(dims, (int, tuple, list)):
        raise TypeError(f"{fn}: dims must be an int or a tuple of ints, got {dims!r}")
    dims_t = (dims,) if isinstance(dims, int) else tuple(dims)
    if not dims_t or any(isinstance(d, bool) or not isinstance(d, int) for d in dims_t):
        raise TypeError(f"{fn}: dims must be an int or a non-empty tuple of ints, got {dims!r}")
    if len(set(dims_t)) != len(dims_t):
        raise ValueError(f"{fn}: dims has a repeated entry: {dims_t}")
    groups = _groups(fn, dims_t, group)
    device = next((t.device for t in model.parameters()), None)

    def check() -> tuple[set[int], Sequence[object]]:
        names = sorted(p if isinstance(p, str) else p.__qualname__ for p in pointwise)
        return _checked(fn, model, dims_t, pointwise), (dims_t, names, double_backward,
                                                         structure(model))

    inside = agreed(fn, groups, _FACTS, device, check)
    ctx = DomainContext(dims_t, groups)
    ctx.fast = not double_backward
    for m in model.modules():
        if id(m) in inside:
            continue
        conv = _forward_for(m)
        if conv is not None:
            _override(m, *conv, ctx)
        elif _qualname(m) == attention.ATTENTION:
            attention.convert(m, ctx)
        elif _qualname(m) == monai.SPATIAL_ATTENTION:
            monai.convert(m, ctx)
        elif _qualname(m) == monai.SUBPIXEL:
            monai.convert_subpixel(m, ctx)
        # a converted layer's parameters include its children's (tltorch's spectral weight)
        if any(True for _ in m.parameters(recurse=conv is not None)):
            _hook_parameters(m, ctx, recurse=conv is not None)
    model.__dict__[_CTX] = ctx
    register_partial_sums(model, ctx)  # a data-parallel reducer takes the sums over
    model.register_forward_pre_hook(_entry, with_kwargs=True, prepend=True)  # before `record`
    model.register_forward_hook(_exit, always_call=True)
    _run_eagerly(model)
    return model


_FACTS = ("dims", "pointwise", "double_backward",
          "the model's layers and parameters (classes, settings, names, shapes, dtypes)")
"""What every rank's call must agree on (compared before anything changes)."""


def _checked(fn: str, model: nn.Module, dims: tuple[int, ...],
             pointwise: Sequence[type | str]) -> set[int]:
    """Refuse ``model`` if it cannot be converted.

    Returns the ids of the modules converted as parts of a whole (left as they are).
    """
    if getattr(model, _CTX, None) is not None:
        raise ValueError(f"{fn}: the model is already domain-parallel")
    inside = _inside_converted(model) | monai.handled_inside(model)
    problems = [p for name, m in model.named_modules()
                if id(m) not in inside and (p := _refusal(name, m, pointwise, dims))]
    if problems:
        raise ValueError(f"{fn}: cannot convert {len(problems)} layer(s):\n  "
                         + "\n  ".join(problems))
    return inside


def _run_eagerly(model: nn.Module) -> None:
    """Make the converted model run eagerly, also under ``torch.compile``; refuse a deep copy.

    While it runs, a torch function mode converts its functional calls (``F.pad``,
    ``F.interpolate``) and gives parameter shares after a global pooling. Dynamo does not
    honour that mode when it traces (a traced ``F.pad`` pads every tile as if it were the
    whole domain: wrong rows, silently), so the model's forward and its entry and exit
    hooks run between graphs (one graph break around the model inside a larger compiled
    one), and ``torch.compile`` directives met while it runs (a compiled submodule) are
    ignored for that time. On a torch without that switch, a compiled submodule is refused.

    A deep copy would share this model's bookkeeping and lack its gradient hooks (its
    gradients would be silently wrong), so ``copy.deepcopy`` raises instead.
    """
    inner: Any = model.forward
    bound = isinstance(inner, types.MethodType) and inner.__self__ is model
    call = inner.__func__ if bound else inner  # else a callable set on the instance

    @functools.wraps(call)  # (its signature: transformers' Trainer reads it)
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(*args: Any, **kwargs: Any) -> Any:
        _refuse_compiled_parts(model)
        with force_eager():
            return call(*args, **kwargs)

    model.forward = types.MethodType(forward, model) if bound else forward
    model.__dict__["__deepcopy__"] = _refuse_copy


def _refuse_copy(memo: dict[int, Any]) -> None:
    raise TypeError("parallelize_domain: a domain-parallel model cannot be deep-copied (the "
                    "copy would share its bookkeeping and miss its gradient hooks); convert "
                    "a copy of the dense model instead and load this one's state_dict into "
                    "it (the names are the dense model's)")


def _refuse_compiled_parts(model: nn.Module) -> None:
    """On a torch that cannot switch compiled code off: refuse compiled submodules."""
    if FORCE_EAGER:
        return
    for name, m in model.named_modules():
        if m is model:  # compiled itself: its forward runs between graphs, as a whole
            continue
        if getattr(m, "_compiled_call_impl", None) is not None \
                or type(m).__name__ == "OptimizedModule":
            raise RuntimeError(
                f"parallelize_domain: {name} is compiled; inside a "
                f"domain-parallel model it would be traced without the tile conversions "
                f"(torch {torch.__version__} cannot switch compiled code off while the "
                f"model runs: torch 2.6 and later can)")


def _groups(fn: str, dims: tuple[int, ...], group: GroupLike) -> list[Group]:
    if type(group).__name__ == "DeviceMesh":
        mesh: Any = group
        if mesh.ndim != len(dims):
            raise ValueError(f"{fn}: the mesh has {mesh.ndim} dim(s) but dims={dims} has "
                             f"{len(dims)}; expected one mesh dim per split dim")
        return [resolve_group(mesh.get_group(i), fn) for i in range(mesh.ndim)]
    if len(dims) != 1:
        raise ValueError(f"{fn}: dims={dims} splits {len(dims)} dims; pass a DeviceMesh with "
                         f"{len(dims)} dims as group (one process group splits one dim)")
    return [resolve_group(group, fn)]


def _override(module: nn.Module, fwd: Forward, optional: tuple[str, ...],
              ctx: DomainContext) -> None:
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        extra = [k for k, v in kwargs.items() if k not in optional or v is not None]
        if args or extra:
            raise TypeError(f"{type(self).__name__} (domain-parallel): extra forward "
                            f"arguments are not supported (got {len(args)} positional, "
                            f"keywords {extra})")
        own: DomainContext = self.__dict__[_CTX]
        kind = own.marks.kind_of(x)
        if own.active:
            refuse_checkpointed(type(self).__name__, x)
        if kind == TILE and fwd not in _NORMS and own.active:
            refuse_unless_image(own, x, type(self).__name__)
        poolings = own.poolings
        as_tiles = own.marks.as_tiles(x)
        buffers = list(self.buffers(recurse=False)) if as_tiles is not None else []
        before = [b.clone() for b in buffers]
        out = _run_layer(self, fwd, own, x, runs_dense(own, kind, x), kind == POOLED)
        own.marks.mark(out, POOLED if own.poolings > poolings else kind)
        if as_tiles is not None and own.poolings == poolings:
            # (a spread that may be a tile: the layer on its tile version too, see `meet`;
            # its running statistics stay the first run's until the tile version is taken)
            first = [b.clone() for b in buffers]
            _copy_into(buffers, before)
            tiles_out = _run_layer(self, fwd, own, as_tiles, False, False)
            if own.poolings > poolings:
                raise ambiguous_spread(f"a global pooling ({type(self).__name__})")
            second = [b.clone() for b in buffers]
            _copy_into(buffers, first)
            own.marks.mark(tiles_out, TILE)
            pending = [*own.marks.pending(x)]
            if buffers:
                pending.append(functools.partial(_copy_into, buffers, second))
            own.marks.keep_as_tiles(out, tiles_out, pending)
        held = own.marks.points(x)  # (a permuted tile: channels-last for a LayerNorm)
        if held is not None and isinstance(out, torch.Tensor) and out.dim() == x.dim():
            own.marks.hold_points(out, held, own.marks.block(x))
            recorded, order, merged = own.marks.order(x)
            if recorded:
                own.marks.hold_order(out, order, merged)
        return out
    module.__dict__[_CTX] = ctx
    module.forward = types.MethodType(forward, module)


def _copy_into(buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, v in zip(buffers, values, strict=True):
            b.copy_(v)


def _run_layer(module: nn.Module, fwd: Forward, ctx: DomainContext, x: torch.Tensor,
               dense: bool, on_pooled: bool) -> torch.Tensor:
    """A converted layer's forward, as the dense layer (pooled features in) or on tiles."""
    before = ctx.dense, ctx.on_pooled, ctx.layer_weights
    ctx.dense, ctx.on_pooled = dense, on_pooled
    # (the tensors in its parameters' places: plain ones under torch.func.functional_call)
    ctx.layer_weights = frozenset(map(id, module.parameters())) if on_pooled else frozenset()
    try:
        with ctx.own_calls():  # its functional calls are tensorpar's own
            return fwd(module, ctx, x)
    finally:
        ctx.dense, ctx.on_pooled, ctx.layer_weights = before


def _hook_parameters(module: nn.Module, ctx: DomainContext, recurse: bool = False) -> None:
    """Sum the module's parameter gradients over the domain when it ran in the forward.

    A parameter used before any global pooling sees only this rank's points: its gradient
    is partial (the dense one is the sum over the domain). A use after it (a head on the
    pooled, replicated features) gives the whole gradient on every rank; the functional-call
    conversion divides that by the number of tiles (`tensorpar.domain._forward.shares`), so every
    gradient is a sum over the domain, whichever side of the pooling each use is on.

    The sums are made once, at the end of the backward pass, for every such parameter in
    the model's order, as one all-reduce per split dim and dtype: a rank whose tile is
    empty computes its (zero) gradients in another order than its peers, so summing each
    gradient as it arrives could pair different parameters' all-reduces. Each gradient
    hook keeps the partial gradient aside and lets zeros through; the end of the backward
    adds the sums to ``.grad`` (so accumulation over several backward passes stays exact).
    ``torch.autograd.grad`` with respect to parameters returns this rank's partial
    gradients as they are (the sums are not made, ``.grad`` is left alone): use
    ``backward()`` for the sums.

    Under a data-parallel reducer (`BucketedAllReduce`, `DistributedDataParallel`) the
    reducer makes the sums in its buckets instead (see ``tensorpar.ddp._partial_sums``), and
    under `fully_shard_domain` FSDP2's hybrid reduction: the gradients go to them as they are.
    """
    key = id(module)

    def record(_: nn.Module, args: object) -> None:
        if ctx.active:
            ctx.ran.add(key)

    module.register_forward_pre_hook(record)
    for p in module.parameters(recurse=recurse):
        if not p.requires_grad:
            continue
        if id(p) in ctx.owners:  # tied to an earlier module's: one hook, either may run
            ctx.owners[id(p)].add(key)
            continue
        ctx.owners[id(p)] = {key}
        ctx.params.append(p)
        p.register_hook(_keeper(ctx, len(ctx.params) - 1))


def _keeper(ctx: DomainContext, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if ctx.handed_over or all(g.is_single for g in ctx.groups):
            return grad  # a data-parallel reducer sums over the domain (or there is none)
        if gradient_is_captured(ctx.params[index]):
            return grad  # torch.autograd.grad: this rank's partial gradient, .grad untouched
        kept = ctx.kept.get(index)
        ctx.kept[index] = grad.detach() if kept is None else kept + grad.detach()
        if not ctx.finish_queued:
            ctx.finish_queued = True
            queue_engine_callback(lambda: _finish(ctx))
        return torch.zeros_like(grad)
    return hook


def _finish(ctx: DomainContext) -> None:
    """End of a backward: sum the kept gradients over the domain, add them to ``.grad``."""
    ctx.finish_queued = False
    kept, ctx.kept = ctx.kept, {}
    params = [(i, p) for i, p in enumerate(ctx.params)
              if not ctx.owners[id(p)].isdisjoint(ctx.ran)]
    if not params:
        return
    # one flat buffer per parameter dtype (a spectral weight is complex), in the model's
    # order: the same buffers on every rank, whatever each rank kept
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for i, p in params:
        by_dtype.setdefault(p.dtype, []).append((i, p))
    with torch.no_grad():
        for dtype, some in by_dtype.items():
            # after the gradients, one count per parameter of the ranks that got one: a
            # parameter no gradient reached anywhere keeps ``.grad`` None, as dense
            reached = torch.tensor([float(i in kept) for i, _ in some]).to(dtype)
            flat = torch.cat([kept[i].reshape(-1).to(dtype) if i in kept else
                              p.new_zeros(p.numel()) for i, p in some] + [reached])
            flat = over_groups(ctx, flat)
            *parts, counts = flat.split([p.numel() for _, p in some] + [len(some)])
            for (_, p), part, count in zip(some, parts, counts.tolist(), strict=True):
                if count == 0:
                    continue
                total = part.view_as(p)
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.add_(total)


def _refuse_replaced_parameters(model: nn.Module, ctx: DomainContext) -> None:
    """Refuse a model whose hooked parameters are gone: their gradients would not be summed.

    FSDP2's ``fully_shard`` (on the model, blocks of it, or a module holding it) replaces
    the parameters; so does assigning a new one. Every rank checks the same model alike.
    """
    if all(g.is_single for g in ctx.groups):
        return  # (nothing to sum)
    current = {id(p) for p in model.parameters()}
    if any(id(p) not in current for p in ctx.params):
        raise ValueError(_REPLACED)


_REPLACED = ("a domain-parallel model whose parameters were replaced after parallelize_domain "
             "converted it (by FSDP2's fully_shard on the model, on blocks of it or on a "
             "module holding it, or by assigning a parameter anew): their gradients would "
             "never be summed over the tiles. For FSDP2 use "
             "tensorpar.nn.fully_shard_domain(model, mesh=mesh) with a 2-D (domain, "
             "replicas) mesh; assign parameters before converting")


@torch.compiler.disable  # type: ignore[untyped-decorator]  # (see `_run_eagerly`)
def _entry(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ctx: DomainContext = model.__dict__[_CTX]
    if not ctx.fsdp:
        _refuse_replaced_parameters(model, ctx)
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if x is None:
        raise TypeError("parallelize_domain: the model's forward got no tensor argument "
                        "(the first one is the image tile)")
    ctx.begin(x, sum(m.training for m in model.modules()))
    calls.enter_functional_mode(ctx)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _exit(model: nn.Module, args: object, output: object) -> None:
    ctx: DomainContext = model.__dict__[_CTX]
    calls.exit_functional_mode(ctx)
    ctx.ahead.finish()  # (rows sent ahead are taken within the forward that sent them)
    refuse_checkpointed("the model's output", output)
    # an image of pooled features spread to a size every (equal) tile has, never told
    # apart from a fixed grid by a tile they met (see `meet`)
    if isinstance(output, torch.Tensor) and output.dim() == ctx.ndim \
            and ctx.marks.as_tiles(output) is not None:
        raise ambiguous_spread("the model's output")


def domain_context(model: nn.Module) -> DomainContext:
    """The `DomainContext` of a model converted by `parallelize_domain`."""
    ctx = getattr(model, _CTX, None)
    if not isinstance(ctx, DomainContext):
        raise ValueError("domain_context: the model was not converted by parallelize_domain")
    return ctx


def domain_layout(model: nn.Module) -> list[dict[int, tuple[int, ...]]]:
    """The splits recorded by the model's last forward, per split dim.

    Entry ``i`` maps each global length seen along split dim ``i`` to every rank's tile
    size (group-rank order): the input's split, and the split each converted layer gave
    its output. Use it to find which rows of the dense output a rank's output tile is.

    Raises:
        ValueError: the model was not converted by `parallelize_domain`.
    """
    return [dict(t) for t in domain_context(model).layouts]
