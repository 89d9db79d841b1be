"""Optimizer state in sharded checkpoints: every moment at its dense offset, like the weights.

An optimizer of a tensor-parallel model keeps, per parameter, tensors of the parameter's
shard shape (Adam's moments, SGD's momentum). ``optimizer.state_dict()`` keys them by
position and gives no offsets, so ``torch.distributed.checkpoint`` would take every rank's
shard for the same tensor. Here they are keyed by the parameter's dense name and travel as
`ShardAtOffset` exactly as `sharded_state_dict` sends the parameters: a checkpoint loads
at another tensor-parallel size and into the dense model's optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensorpar._torch import global_optimizer_hooks_hidden
from tensorpar.comm._faults import raise_translated
from tensorpar.nn.state._params import ParamInfo, parameter_infos, retag
from tensorpar.nn.state.checkpoint import copy_into, dcp_value, local_of

__all__ = ["load_sharded_optimizer_state_dict", "sharded_optimizer_state_dict"]


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer
                                 ) -> dict[str, Any]:
    """The optimizer's state for ``torch.distributed.checkpoint``, every shard at its offset.

    ``{"state": {dense name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.
    A state tensor of the parameter's shape is a `ShardAtOffset` viewing this rank's
    shard (or a plain tensor / ``DTensor`` for a replica), so ``dcp.load`` into this dict
    writes straight into the optimizer; scalars (``step``) are saved once. Saving changes
    nothing: a parameter that has no state yet (before the first step, or one that has had
    no gradient) is saved as ``has_state[name] == 0`` beside the state it would start from,
    made on a throwaway copy, so that a fresh optimizer has tensors to load into; loading
    leaves such a parameter without state, and its first step creates it exactly as in a
    run that never saved. On a model that is not parallelised it gives plain tensors in
    the same layout.
    Under ``fully_shard`` (FSDP2 beside tensor parallelism) the state of a shard is the
    FSDP slice's pieces at their dense offsets and the state of a replica stays a
    ``DTensor``, so the checkpoint loads at any data x tensor-parallel layout, with or
    without FSDP2. A pipeline's tied LM head (a parameter of its own on the last stage) is
    saved under the dense model's name for it, the embedding's; a pipeline's groups list
    the names of every stage, so the checkpoint loads at another pipeline size or into the
    dense model's optimizer. For a pipeline over several ranks, call it on **every rank
    of the pipeline** (as ``dcp.save`` and ``dcp.load`` are): it all-gathers the groups'
    names over the pipeline's ranks; otherwise there is no communication.

    Args:
        model: the model whose parameters ``optimizer`` updates.
        optimizer: a ``torch.optim`` optimizer whose per-parameter state tensors have the
            parameter's shape (Adam, AdamW, SGD, Adagrad, RMSprop, ...).

    Returns:
        The state to pass to ``dcp.save`` or ``dcp.load``.

    Raises:
        ValueError: ``optimizer`` holds a parameter that is not ``model``'s, or a state
            tensor whose shape is neither the parameter's nor a scalar.
        TypeError: a parameter has no state yet and the optimizer's class cannot be built
            from its parameter groups alone.
        ValueError: (a pipeline, on every rank) another rank raised, or the ranks' groups
            differ in number, or a tied weight's two copies are in different groups.

    Example:
        >>> import torch
        >>> import tensorpar
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> state = tensorpar.sharded_optimizer_state_dict(model, opt)
        >>> sorted(state["state"]["weight"])
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> int(state["has_state"]["weight"]), len(opt.state)  # nothing was created
        (0, 0)
    """
    fn = "sharded_optimizer_state_dict"
    state: dict[str, Any] = {}
    has_state: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    problem: Exception | None = None
    try:  # (a pipeline's ranks then gather their names: every rank gets there)
        infos = _infos(model, optimizer, fn)
        initial = _initial_states(optimizer, fn)
        for group in optimizer.param_groups:
            names = []
            for p in group["params"]:
                info = infos[id(p)]
                name = _saved_name(model, info.name)
                names.append(name)
                own = optimizer.state.get(p)
                has_state[name] = torch.tensor(int(bool(own)), dtype=torch.int8)
                state[name] = {key: _value(info, key, value)
                               for key, value in (own or initial[id(p)]).items()}
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": names})
    except (ValueError, TypeError) as e:
        problem = e
    every = _every_stage_names(model, groups, problem)
    if problem is not None:
        raise problem
    for group, names in zip(groups, every, strict=True):
        group["params"] = names
    return {"state": state, "param_groups": groups, "has_state": has_state}


def _saved_name(model: nn.Module, name: str) -> str:
    """The name a parameter's state is checkpointed under: the dense model's.

    A pipeline's last stage holds a tied LM head as a parameter of its own; the dense
    model's optimizer holds it once, under the embedding's name (`Pipeline.saved_as`).
    """
    saved_as: Mapping[str, str] = getattr(model, "saved_as", None) or {}
    return saved_as.get(name, name)


def _every_stage_names(model: nn.Module, groups: list[dict[str, Any]],
                       problem: Exception | None,
                       fn: str = "sharded_optimizer_state_dict") -> list[list[str]]:
    """Each group's names over every stage of a pipeline (one small all-gather), in order.

    Each pipeline rank's groups hold its own stages' parameters, and a checkpoint keeps
    one rank's copy of such a value: the union is the same on every rank, and what the
    dense model's optimizer holds. Anything but a pipeline of several ranks: its own.
    ``problem``: this rank's error, if it had one; the others then raise too.

    Raises:
        ValueError: on every rank of the pipeline: another rank raised, the ranks hold
            different numbers of groups, or a tied weight's copies are in different groups.
    """
    mine = [list(g["params"]) for g in groups]
    stages = getattr(model, "stage_group", None)
    if stages is None or stages.is_single:
        return mine
    gathered: list[Any] = [None] * stages.size
    try:
        dist.all_gather_object(gathered, (problem is not None, mine), group=stages.handle)
    except RuntimeError as exc:  # a stage's rank gone: named, as a collective's would be
        raise_translated(exc, "all_gather_object (the stages' parameter names)", stages)
    failed = [r for r, (bad, _) in enumerate(gathered) if bad]
    if failed:
        if problem is not None:
            return []  # the caller raises this rank's own error
        raise ValueError(f"{fn}: rank(s) {failed} of the pipeline raised (their error says "
                         f"why)")
    counts = [len(theirs) for _, theirs in gathered]
    if len(set(counts)) > 1:
        raise ValueError(f"{fn}: the pipeline's ranks hold {counts} parameter groups (rank "
                         f"order); expected the same groups on every rank")
    every = [list(dict.fromkeys(n for _, theirs in gathered for n in theirs[i]))
             for i in range(len(mine))]
    seen: dict[str, int] = {}
    for i, names in enumerate(every):
        for name in names:
            if seen.setdefault(name, i) != i:  # a tied weight's copies, on two ranks
                raise ValueError(f"{fn}: {name!r} is in group {seen[name]} on one rank of the "
                                 f"pipeline and in group {i} on another (a tied weight's two "
                                 f"copies); expected one group, as in the dense model")
    return every


def _check_groups(fn: str, here: list[list[str]], saved: list[list[str]]) -> None:
    """Refuse a parameter that the checkpoint puts in another group than the optimizer.

    A group's options are loaded by position, so such a parameter would take another
    group's (a weight without its decay). Names a group of the checkpoint does not list
    are not checked (a checkpoint of a pipeline saved before its groups listed every
    stage's names holds one rank's).
    """
    where = {name: j for j, names in enumerate(saved) for name in names}
    moved = [(name, where[name], i) for i, names in enumerate(here) for name in names
             if where.get(name, i) != i]
    if moved:
        name, j, i = moved[0]
        raise ValueError(f"{fn}: {len(moved)} parameter(s) are in another group in the "
                         f"checkpoint than in the optimizer, e.g. {name!r}: group {j} there, "
                         f"group {i} here; expected the groups in the same order")


def _refuse_unknown(fn: str, every: list[list[str]], saved: list[dict[str, Any]]) -> None:
    """Refuse a checkpoint whose groups list parameters the model (every stage) lacks.

    Such a checkpoint is another model's (deeper, or other names): DCP reads only the keys
    asked for, so without this it would load cut to fit, silently. (State for a parameter
    the model has but the optimizer leaves out, a frozen one, is not read.)
    """
    known = {name for names in every for name in names}
    unknown = [name for g in saved for name in g["params"] if name not in known]
    if unknown:
        raise ValueError(f"{fn}: the checkpoint holds optimizer state for {len(unknown)} "
                         f"parameter(s) this model does not have, e.g. {unknown[0]!r}; "
                         f"expected a checkpoint of this model (saved at any parallel size)")


def load_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                      state: Mapping[str, Any]) -> None:
    """Copy a state filled by ``dcp.load`` into ``optimizer`` (hyperparameters included).

    ``state`` is what `sharded_optimizer_state_dict` returned for this model and optimizer
    (then loaded, possibly from a checkpoint saved at another tensor-parallel size or by
    the dense model). Tensors DCP wrote in place are left alone; everything else is copied.
    A parameter the checkpoint saved without state is left without state (its first step
    creates it, as in the run that saved).

    Args:
        model: the model whose parameters ``optimizer`` updates.
        optimizer: its optimizer.
        state: its sharded optimizer state, loaded.

    Raises:
        KeyError: ``state`` lacks one of the optimizer's parameters or a state key.
        ValueError: the parameter groups differ from the checkpoint's, or the checkpoint
            holds state for a parameter the model does not have (another model's, e.g. a
            deeper one; on every rank of a pipeline, which all-gathers its stages' names).
    """
    fn = "load_sharded_optimizer_state_dict"
    saved, saved_groups = state["state"], state["param_groups"]
    has_state = state.get("has_state", {})
    names_of: list[list[str]] = []
    problem: Exception | None = None
    try:  # (a pipeline's ranks then gather their names: every rank gets there)
        infos = _infos(model, optimizer, fn)
        names_of = [[_saved_name(model, infos[id(p)].name) for p in g["params"]]
                    for g in optimizer.param_groups]
    except ValueError as e:
        problem = e
    own = [_saved_name(model, name) for name, _ in model.named_parameters()]
    every = _every_stage_names(model, [{"params": own}], problem, fn)
    if problem is not None:
        raise problem
    _refuse_unknown(fn, every, saved_groups)
    # state to create: typed like the parameters (DTensor under FSDP2); only where it is
    # saved, so a parameter that stays without state costs no throwaway step
    fresh = _initial_states(optimizer, fn, {
        id(p) for g in optimizer.param_groups for p in g["params"]
        if int(has_state.get(_saved_name(model, infos[id(p)].name), 1))})
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{fn}: the checkpoint has {len(saved_groups)} parameter groups, the "
                         f"optimizer {len(optimizer.param_groups)}; expected the same groups")
    _check_groups(fn, names_of, [list(g["params"]) for g in saved_groups])
    with torch.no_grad():
        for group, saved_group, names in zip(optimizer.param_groups, saved_groups, names_of,
                                             strict=True):
            for k, v in saved_group.items():
                if k != "params":
                    group[k] = v
            for p, name in zip(group["params"], names, strict=True):
                if name not in saved:
                    raise KeyError(f"{fn}: the state lacks parameter {name!r}")
                if not int(has_state.get(name, 1)):
                    optimizer.state.pop(p, None)
                    continue
                own = optimizer.state[p]
                if not own:
                    own.update(fresh[id(p)])
                for key, value in saved[name].items():
                    current = own.get(key)
                    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                        copy_into(current, value)
                    else:
                        own[key] = local_of(value).clone() \
                            if isinstance(value, torch.Tensor) else value


def _infos(model: nn.Module, optimizer: torch.optim.Optimizer, fn: str) -> dict[int, ParamInfo]:
    retag(model)
    infos = {id(info.param): info for info in parameter_infos(model)}
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in infos:
                raise ValueError(f"{fn}: parameter {j} of the optimizer's group {i} (shape "
                                 f"{tuple(p.shape)}) is not a parameter of the model; expected "
                                 f"the model whose parameters the optimizer updates")
    return infos


def _value(info: ParamInfo, key: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape != info.param.shape:
        raise ValueError(f"sharded_optimizer_state_dict: the state {key!r} of {info.name!r} has "
                         f"shape {tuple(value.shape)}; expected the parameter's shape "
                         f"{tuple(info.param.shape)} or a scalar (this optimizer's state cannot "
                         f"be placed at offsets)")
    return dcp_value(value, info.shard if info.sharded else None, info.dim)


def _initial_states(optimizer: torch.optim.Optimizer, fn: str,
                    wanted: set[int] | None = None) -> dict[int, dict[str, Any]]:
    """The state each parameter without one would get, made on copies (``optimizer`` untouched).

    A throwaway optimizer of the same class and hyperparameters steps once at learning rate 0
    over zero-filled twins of those parameters (of the ids in ``wanted``, where given) with
    zero gradients; its state has the keys, shapes and dtypes the real one will have, so
    ``dcp.load`` has tensors to write into.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]
              if not optimizer.state.get(p) and (wanted is None or id(p) in wanted)]
    if not params:
        return {}
    twins = {id(p): torch.zeros_like(p) for p in params}
    groups = []
    for g in optimizer.param_groups:
        mine = [twins[id(p)] for p in g["params"] if id(p) in twins]
        if mine:
            lr = g["lr"].clone().fill_(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine,
                           "lr": lr})
    try:
        shadow = type(optimizer)(groups)  # type: ignore[call-arg]
    except TypeError as e:
        raise TypeError(f"{fn}: cannot build a {type(optimizer).__name__} from its parameter "
                        f"groups alone ({e}) to learn the state of the parameters that have "
                        f"none yet; expected an optimizer constructible as cls(param_groups), "
                        f"or one step taken before saving") from e
    for twin in twins.values():
        twin.grad = torch.zeros_like(twin)
    with global_optimizer_hooks_hidden():  # not a step of the run: its hooks do not see it
        shadow.step()
    return {pid: shadow.state[twin] for pid, twin in twins.items()}
