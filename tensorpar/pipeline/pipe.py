"""The pipeline: one rank's stages of a dense model, and the training step that runs them."""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge

from tensorpar._torch import has_post_accumulate_hooks, is_fsdp_module
from tensorpar.collectives._autograd import torch_op
from tensorpar.comm._comm import all_reduce
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError, TensorparError
from tensorpar.pipeline.p2p import (
    Inbox,
    Link,
    Meta,
    NothingSent,
    fetch_gradient,
    follows_for,
    gradient_sent,
    linger,
    receive_edge,
    recv_activation,
    room_for,
    send_activation,
    send_no_gradient,
    send_nothing,
    send_unused,
)
from tensorpar.pipeline.schedules import SCHEDULES, SPLIT, Action, build_schedule, in_order
from tensorpar.pipeline.split_backward import WeightGrads, backward_input, supported
from tensorpar.pipeline.stages import (
    Decoder,
    StageSpec,
    decoder_of,
    has_blocks,
    is_transformers,
    prune,
    run_stage,
    stage_specs,
    tied_parameters,
)
from tensorpar.placeholder import FORMAT_VERSION, TensorPlaceholder
from tensorpar.validation.calls import agreed, structure

__all__ = ["Pipeline", "StepFailed", "pipeline"]

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]

_MODEL_INPUTS = ("attention_mask", "position_ids")
"""The keyword inputs of a transformers model that `Pipeline.step` splits by microbatch."""


class Pipeline(nn.Module):
    """This rank's stages of a dense model, run over microbatches by a schedule.

    Built by `pipeline`. Its submodules are the dense model's, under their dense names
    (only those of this rank's stages), so ``parameters()``, ``named_parameters()``,
    ``state_dict()``, `tensorpar.sharded_state_dict` and `tensorpar.parallelize` see the
    dense model's names. Call `step` on every rank of the group together.

    Attributes:
        stages: the specs of this rank's (virtual) stages, in order.
        num_stages: the number of (virtual) stages over the whole group.
        microbatches: microbatches per step.
        schedule: the schedule's name.
        last_busy: seconds the last `step` spent computing on this rank (its forwards and
            backwards, less the time their receives waited): ``1 - last_busy / step time``
            is this rank's bubble.
        last_timeline: the last `step`'s actions on this rank with their start and end,
            in seconds from the start of the step (receives included).
    """

    def __init__(self, model: nn.Module, *, group: GroupLike, microbatches: int,
                 schedule: str, loss_fn: LossFn | None, virtual_stages: int,
                 split: Sequence[int] | None, loss_reduction: str = "mean") -> None:
        super().__init__()
        g = resolve_group(group, "pipeline")
        device = next((t.device for t in model.parameters()), None)

        def check() -> tuple[Any, Sequence[object]]:
            cut = _cut(model, g, microbatches, schedule, loss_fn, virtual_stages, split,
                       loss_reduction)
            return cut, (microbatches, schedule, virtual_stages, loss_reduction,
                         loss_fn is not None, FORMAT_VERSION, [s.blocks for s in cut[0]],
                         structure(model))

        specs, rows, hf, tied = agreed("pipeline", [g], _FACTS, device, check)
        mine = [s for s in specs if s.index % g.size == g.rank]
        self._decoder: Decoder | None = decoder_of(model) if hf else None
        self._loss_function: Any = getattr(model, "loss_function", None) if hf else None
        # a parameter on two ranks' stages (an embedding tied to the LM head): the two
        # halves of its gradient are summed after each step
        self._tied: list[tuple[str, int, int]] = []  # (name here, peer, which pair)
        first = {id(p): n for n, p in reversed(list(model.named_parameters(
            remove_duplicate=False)))}  # the name the dense model's named_parameters gives
        self.saved_as: dict[str, str] = {}
        """Each tied copy held here under another name than the dense model's first one
        (a tied LM head on the last stage): the name its checkpointed state goes by."""
        for pair, (pid, where) in enumerate(tied.items()):
            for r, name in where:
                if r == g.rank:
                    self._tied.append((name, next(o for o, _ in where if o != r), pair))
                    if first[pid] != name:
                        self.saved_as[name] = first[pid]
        prune(model, mine, specs)
        for name, child in model._modules.items():
            if child is not None:
                self.add_module(name, child)
        for name, param in model._parameters.items():  # a model's own (positions, ...)
            if param is not None:
                self.register_parameter(name, param)
        for name, buf in model._buffers.items():
            if buf is not None:
                self.register_buffer(name, buf, persistent=name not in
                                     model._non_persistent_buffers_set)
        self._group = g
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.stages: tuple[StageSpec, ...] = tuple(mine)
        self.num_stages = len(specs)
        self.microbatches = microbatches
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self._rows = rows  # every rank's actions: the order a peer sends in
        self._actions: list[Action] = rows[g.rank]
        self._fsdp_modules: list[tuple[str, Any]] = []  # (name, FSDP2 module), at each step
        # gloo pairs transfers by tag: receives may be posted ahead of the schedule's order
        self._eager = g.size > 1 and "gloo" in _backend(g)
        self.last_busy = 0.0  # seconds the last step computed (its actions less their receives)
        self.last_timeline: list[tuple[Action, float, float]] = []
        # the room of each activation transfer's frame in the next step (the bytes it
        # carried in the last step, up to a limit), keyed (microbatch, sending stage) here
        # and (microbatch, receiving stage) on the receiver, so that an activation whose
        # size repeats travels in one message with its header
        self._rooms_out: dict[tuple[int, int], int] = {}
        self._rooms_in: dict[Hashable, int] = {}
        # the same for an activation larger than a frame: the bytes of its data message,
        # whose receive is posted ahead (gloo) when the same transfer's size repeats
        self._follows_out: dict[tuple[int, int], int] = {}
        self._follows_in: dict[Hashable, int] = {}

    # -- where things are -------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline's process group (``None``: the default group or a single process)."""
        return self._group.handle

    @property
    def stage_group(self) -> Group:
        """The resolved pipeline group (a gradient norm over the pipeline reduces over it)."""
        return self._group

    @property
    def is_first(self) -> bool:
        """This rank runs the first stage (it takes the batch)."""
        return self._group.rank == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (it takes the target and returns the loss)."""
        return (self.num_stages - 1) % self._group.size == self._group.rank

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _link(self, stage: int, microbatch: int, outgoing: bool,
              pending: list[Any], waited: list[float]) -> Link:
        """The link of the activation leaving ``stage`` (``outgoing``) or entering it."""
        src = stage if outgoing else stage - 1
        peer = (src + 1) % self._group.size if outgoing else src % self._group.size
        tag = 2 * (microbatch * self.num_stages + src)
        return Link(self._group, peer, tag, tag + 1, pending, waited, self._eager)

    # -- the step -------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | TensorPlaceholder | None = None,
             target: Any = None, *, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor | TensorPlaceholder:
        """One training step's forwards and backwards over the microbatches.

        Gradients accumulate into ``.grad`` as ``loss.backward()`` would (zero them
        between steps). Call on every rank of the group.

        Args:
            inputs: the whole batch on the first stage (token ids for a transformers
                model); ``None`` or a placeholder elsewhere (ignored).
            target: the whole batch's target on the last stage (``labels`` for a
                transformers model); ignored elsewhere.
            attention_mask: a transformers model's attention mask for the whole batch
                (``(B, T)``: 1 for a token, 0 for padding), given on every rank: each
                stage's forward takes its microbatch's rows.
            position_ids: a transformers model's positions (``(B, T)``; restarting
                within a row for packed sequences), given on every rank likewise.

        Returns:
            The batch loss on the last stage (detached): the microbatch losses weighted by
                their share of the batch (of the label tokens, for a transformers model's
                own loss), so a mean-reduced loss equals the dense model's. A 0-d
                placeholder (``owner``: the last stage's rank) elsewhere.

        Raises:
            CollectiveArgumentError: the first stage got no tensor, the last no target,
                the batch has fewer rows than microbatches, gradients are enabled on some
                ranks only, or ``attention_mask`` /
                ``position_ids`` are not given on every rank with the batch's rows, or
                given to a model that is not a transformers causal LM (raised on every
                rank).
            NothingSent: another rank raised during the step, and this one waited for an
                activation or a gradient from it.
            StepFailed: another rank raised during the step after this one had done its
                part. (Any error in the step raises on every rank; the gradients then
                hold part of the step.) Also, before any transfer, when an earlier step
                on this group failed where receives are not posted ahead (NCCL): use a
                new group.
        """
        if self._group.handle in _LEFT_IN_FLIGHT:  # before any transfer: it would pair
            raise StepFailed(                      # with what the failed step left
                "Pipeline.step: an earlier step failed on this pipeline's process group and "
                "left sends that no rank received (receives are not posted ahead on this "
                "backend): the group's next transfers would pair with them. Build the "
                "pipeline on a new process group (torch.distributed.new_group)")
        # fully_shard may come after the pipeline is built: looked up at every step
        self._fsdp_modules = [(n, m) for n, m in self.named_modules() if is_fsdp_module(m)]
        given = {name: t for name, t in zip(_MODEL_INPUTS, (attention_mask, position_ids),
                                            strict=True) if t is not None}
        problem = self._check(inputs, target) or self._check_model_inputs(given)
        self._agree(problem, inputs, target, given)
        # each tied copy's gradient before the step, set aside: the holders add up what
        # this step adds to each copy (`_sum_tied_gradients`)
        before = {name: self._set_aside(name) for name, _, _ in self._tied}
        pending: list[Any] = []
        batch = list(torch.tensor_split(inputs, self.microbatches)) \
            if self.is_first and isinstance(inputs, torch.Tensor) else []
        targets, weights = self._targets(target) if self.is_last else ([], [])
        cut = {name: torch.tensor_split(t, self.microbatches) for name, t in given.items()}
        model_inputs = [{name: parts[i] for name, parts in cut.items()}
                        for i in range(self.microbatches)]
        held: dict[tuple[int, int], Any] = {}
        total: torch.Tensor | None = None
        single = self._group.size == 1
        device = self._device()
        waited = [0.0]
        busy = 0.0
        origin = time.perf_counter()
        self.last_timeline = []
        final_backward = {a.stage: a.microbatch for a in self._actions if a.kind == "B"}
        split = self.schedule == SPLIT
        received: dict[tuple[int, int], _Received] = {}  # what each backward owes its sender
        deferred: dict[tuple[int, int], WeightGrads] = {}  # each B's W half
        # every activation this step receives: headers posted now, data as they arrive
        inbox = Inbox({(a.microbatch, a.stage): self._link(a.stage, a.microbatch, False,
                                                           pending, waited)
                       for a in self._actions if a.kind == "F" and a.stage > 0},
                      device, self._rooms_in, self._follows_in) if self._eager else None
        sent: set[tuple[int, int]] = set()  # the activations this step sent (or tried)
        taken: set[tuple[int, int]] = set()  # the activations it received (or tried)
        try:
            for action in self._actions:
                k, i = action.stage, action.microbatch
                spec = self.stages[k // self._group.size]
                start = time.perf_counter()
                if action.kind == "F":
                    if k == 0:
                        x = batch[i]
                    elif single:
                        x = held.pop((i, k - 1))
                    else:
                        taken.add((i, k))  # (also if the receive raises: the frame is used)
                        x = self._receive(inbox, k, i, pending, waited, device)
                    edge = receive_edge(x) if k > 0 and not single else None
                    if edge is not None:  # taken before the stage runs: it may modify x in place
                        received[(i, k)] = _Received(edge, x.grad_fn,
                                                     Meta(x.shape, x.dtype, x.device))
                    y = run_stage(self, spec, x, self._decoder, model_inputs[i])
                    if spec.last:
                        loss = self._loss(y, targets[i], weights[i])
                        total = loss.detach() if total is None else total + loss.detach()
                        held[(i, k)] = loss
                    elif single:
                        held[(i, k)] = y
                    else:
                        link = self._link(k, i, True, pending, waited)
                        sent.add((i, k))
                        held[(i, k)] = send_activation(
                            y, link, self._rooms_out.get((i, k), 0),
                            f"Pipeline.step: stage {k}'s output (microbatch {i}) to stage {k + 1} "
                            f"on rank {link.peer}", self._follows_out.get((i, k), 0))
                        self._rooms_out[(i, k)] = room_for(y)
                        if self._eager:
                            self._follows_out[(i, k)] = follows_for(y)
                elif action.kind == "W":
                    work = deferred.pop((i, k), None)
                    if work is not None:
                        with _outside_autocast(device):
                            work.run()
                elif spec.last or not single:  # the loss, or the send's placeholder
                    self._gradient_sync(final_backward[k] == i)
                    done = held.pop((i, k))
                    came = received.get((i, k))  # owed until its gradient has gone
                    # a stage whose output needs no gradient: none comes
                    if done.requires_grad and split:  # B now, W when the schedule says
                        out, grad = (done, None) if spec.last else _anchor_of(done)
                        if not spec.last and not self._eager:
                            # received now, in the order the peer sends, also if W
                            # runs the whole backward (an input that needs no gradient)
                            fetch_gradient(out)
                        with _outside_autocast(device):
                            deferred[(i, k)] = backward_input(
                                out, grad, [came.edge] if came is not None else [])
                        del out, grad  # the graph lives on in W's hands only
                    elif done.requires_grad:
                        with _outside_autocast(device):
                            done.backward()
                    del done
                    if came is not None and not gradient_sent(came.node):
                        # the stage did not use what it received: its sender still waits,
                        # and learns that no gradient comes (none, as dense has none)
                        send_unused(self._link(k, i, False, pending, waited).reverse(),
                                    came.meta)
                    received.pop((i, k), None)
                end = time.perf_counter()
                busy += end - start
                self.last_timeline.append((action, start - origin, end - origin))
                # let go of sends that are done: their tensors would otherwise live to the end
                # (NCCL's; gloo's report completion only once waited for)
                pending[:] = [(work, kept) for work, kept in pending if not work.is_completed()]
        except BaseException as error:  # every other rank raises too, instead of waiting
            self._restore_tied(before)
            if not single:
                self._recover(error, sent, received, taken, inbox, device, pending)
            raise
        # agreed before the sends are waited for: where receives are not posted ahead, a
        # rank that raised never takes what was sent to it
        failed = self._failed_ranks(False) if not single else []
        if failed:
            self._restore_tied(before)
            self._settle(pending, inbox)
            raise StepFailed(
                f"Pipeline.step: the step failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} of the pipeline (the errors there say why; "
                f"NothingSent on a rank: it stopped because another raised); this rank's "
                f"gradients hold part of the step: zero them")
        _wait_all(pending)
        if inbox is not None:  # the stand-ins for data receives posted ahead
            _wait_all(inbox.in_flight())
        if self._tied:
            self._sum_tied_gradients(before)
        self.last_busy = busy - waited[0]
        if self.is_last:
            assert total is not None
            return total
        return TensorPlaceholder((), next((p.dtype for p in self.parameters()
                                           if p.is_floating_point()), torch.float32),
                                 device=device, owner=(self.num_stages - 1) % self._group.size,
                                 group=self.group)

    def _recover(self, error: BaseException, sent: set[tuple[int, int]],
                 received: dict[tuple[int, int], _Received],
                 taken: set[tuple[int, int]], inbox: Inbox | None, device: torch.device,
                 pending: list[Any]) -> None:
        """After an error in a step: let every other rank raise too, and leave no transfer.

        The ranks of the next stages get a frame that says no activation comes, those of
        the earlier stages one that says no gradient comes, for what this rank still owes
        them; they raise `NothingSent` instead of waiting, and do the same in turn. Where
        receives are posted ahead (gloo), every one of them is answered: this rank waits for
        the frames of the activations it did not take and answers those that wait for a
        gradient. Then the ranks agree, in one small all-reduce, that the step failed (a
        rank that finished its part raises `StepFailed`).
        """
        try:
            self._send_nothing(sent, device, pending)
            # a sender that raised waits for no gradient
            sender_raised = isinstance(error, NothingSent) and error.peer == self._sender()
            self._send_no_gradients(received, taken, inbox, pending, sender_raised)
            self._failed_ranks(True)
        except Exception as cleanup:  # a peer gone: the step's own error says more
            warnings.warn(f"Pipeline.step: after the step's error, telling the other ranks "
                          f"failed too ({type(cleanup).__name__}: {cleanup})", stacklevel=3)
            self._leave(_in_flight(pending, inbox))
            return
        self._settle(pending, inbox)

    def _settle(self, pending: list[Any], inbox: Inbox | None) -> None:
        """After the ranks agreed that the step failed: finish or keep its transfers.

        Where receives are posted ahead, every transfer of the step has its other side
        posted by now (each rank answered what it owed before the agreement): wait for
        them. Otherwise sends may have no receiver: `_leave` them.
        """
        works = _in_flight(pending, inbox)
        if not self._eager:
            self._leave(works)
            return
        _wait_all(works)

    def _leave(self, works: list[tuple[Any, Any]]) -> None:
        """Keep a failed step's ``works`` alive (`linger`).

        Where receives are not posted ahead, a send may never be received: the group is
        refused to every later step, on every rank (each learns that the step failed).
        """
        linger(works)
        if not self._eager and self._group.handle is not None:
            _LEFT_IN_FLIGHT.add(self._group.handle)

    def _sender(self) -> int:
        """The rank that sends this one its activations (and takes their gradients)."""
        return (self._group.rank - 1) % self._group.size

    def _send_no_gradients(self, received: dict[tuple[int, int], _Received],
                           taken: set[tuple[int, int]], inbox: Inbox | None,
                           pending: list[Any], sender_raised: bool) -> None:
        """Tell the earlier stages' ranks that the gradients this rank owes will not come.

        Where receives are not posted ahead, only the one its sender waits for: the first,
        in this rank's order of backwards, whose gradient has not gone (an activation not
        taken yet is received first, with those sent before it), unless the sender raised
        (``sender_raised``).
        """
        def refuse(key: Any, meta: Meta) -> None:  # key: (microbatch, receiving stage)
            i, k = key
            send_no_gradient(self._link(k, i, False, pending, [0.0]).reverse(), meta)

        device = self._device()
        sender = self._rows[self._sender()]
        sent_in_order = [(a.microbatch, a.stage + 1) for a in sender
                         if a.kind == "F" and a.stage + 1 < self.num_stages]
        owed = [(key, came.meta) for key, came in received.items()
                if not gradient_sent(came.node)]
        if inbox is not None:  # all of them, and those of the activations not taken
            for key, meta in owed:
                refuse(key, meta)
            inbox.drain(sent_in_order, lambda key, h: refuse(
                key, Meta(h.shape, h.tensor_dtype, device)) if h.requires_grad else None)
            return
        if sender_raised:  # it waits for nothing
            return
        # the sender takes the gradients in this rank's order of backwards: it waits for
        # the first that has not gone, taken here or not
        unanswered = dict(owed)
        untaken = [key for key in sent_in_order if key not in taken]
        for action in self._actions:
            key = (action.microbatch, action.stage)
            if action.kind != "B" or action.stage == 0 or (key in taken and
                                                           key not in unanswered):
                continue  # no sender, or its gradient went (or none was needed)
            if key in unanswered:
                refuse(key, unanswered[key])
                return
            # not taken: its frame comes after those of the activations not taken before it
            for early in untaken[:untaken.index(key) + 1]:
                i, k = early
                try:
                    x, _ = recv_activation(None, self._link(k, i, False, pending, [0.0]),
                                           device, self._rooms_in.get(early, 0))
                except NothingSent:  # its sender raised: it waits for no gradient
                    return
            if x.requires_grad:
                refuse(key, Meta(x.shape, x.dtype, x.device))
            return

    def _failed_ranks(self, failed: bool) -> list[int]:
        """The ranks whose step failed (``failed``: this one), agreed in one all-reduce."""
        flags = torch.zeros(self._group.size, dtype=torch.int32,
                            device=self._group.comm_device(self._device()))
        flags[self._group.rank] = int(failed)
        all_reduce(flags, torch_op("sum"), self._group)
        return [r for r, flag in enumerate(flags.tolist()) if flag]

    def _restore_tied(self, before: dict[str, torch.Tensor | None]) -> None:
        """After a failed step: each tied copy's set-aside gradient back, plus what it got."""
        for name, kept in before.items():
            weight = self.get_parameter(name)
            if kept is not None:
                weight.grad = kept if weight.grad is None else kept + weight.grad

    def _send_nothing(self, sent: set[tuple[int, int]], device: torch.device,
                      pending: list[Any]) -> None:
        """Tell the next stages' ranks that the activations this rank owes will not come.

        Each gets a frame that says so (only the next one where receives are not posted
        ahead: its receiver stops there).
        """
        owed = [(a.microbatch, a.stage) for a in self._actions
                if a.kind == "F" and (a.microbatch, a.stage) not in sent
                and not self.stages[a.stage // self._group.size].last]
        for i, k in owed if self._eager else owed[:1]:
            link = self._link(k, i, True, pending, [0.0])
            send_nothing(link, self._rooms_out.get((i, k), 0), device,
                         self._follows_out.get((i, k), 0))

    def _receive(self, inbox: Inbox | None, k: int, i: int, pending: list[Any],
                 waited: list[float], device: torch.device) -> torch.Tensor:
        """Stage ``k``'s input of microbatch ``i``, from the previous stage's rank."""
        link = self._link(k, i, False, pending, waited)
        try:
            if inbox is not None:
                return inbox.take((i, k))
            x, self._rooms_in[(i, k)] = recv_activation(None, link, device,
                                                        self._rooms_in.get((i, k), 0))
            return x
        except NothingSent as e:
            raise NothingSent(
                f"Pipeline.step: stage {k - 1} (rank {link.peer}) sent no activation to stage "
                f"{k} (microbatch {i}): it raised instead (its error says why)",
                link.peer) from e

    def stage_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules this rank's stages call, by dense name, in order.

        The blocks of an ``nn.Sequential``; a transformers model's decoder layers, with the
        embedding on the first stage and the final norm and LM head on the last; the
        modules a model's ``pipeline_blocks()`` named. The step calls these directly (never
        the pipeline's or the decoder's own forward), so they are what ``fully_shard``
        takes across pipeline replicas.
        """
        out = []
        for spec in self.stages:
            for name in spec.holds:
                try:
                    out.append((name, self.get_submodule(name)))
                except AttributeError:  # a parameter a model's block holds, not a module
                    continue
        return out

    def _gradient_sync(self, final: bool) -> None:
        """FSDP2 across replicas reduces a stage's gradients in its last backward only.

        Earlier microbatches accumulate unsharded gradients (FSDP2's gradient accumulation),
        so each stage reduce-scatters once per step instead of once per microbatch. Only
        the modules of the stage whose backward runs next read the flag.
        """
        for _, module in self._fsdp_modules:
            module.set_requires_gradient_sync(final, recurse=False)

    def tied_copies(self) -> list[nn.Parameter]:
        """Parameters whose gradient another stage holds too (a tied LM head on the last).

        After `step` both holders have the same gradient; a norm over the whole pipeline
        (`tensorpar.nn.grad_norm`) counts it on the lower rank only, so these are the
        higher rank's copies.
        """
        return [self.get_parameter(name) for name, peer, _ in self._tied
                if peer < self._group.rank]

    def _set_aside(self, name: str) -> torch.Tensor | None:
        """The tied copy ``name``'s gradient, taken off it (the step's start from none)."""
        weight = self.get_parameter(name)
        grad, weight.grad = weight.grad, None
        return grad

    def _sum_tied_gradients(self, before: dict[str, torch.Tensor | None]) -> None:
        """Add what this step gave each tied parameter's two holders, in the same order on both.

        ``before``: each copy's gradient before the step (`_set_aside`), which both holders
        have alike; the sum of the two steps' gradients is added to it. Where neither
        holder's copy got one (a step under ``torch.no_grad()``, a frozen parameter), the
        gradient stays what it was.
        """
        base = 2 * self.microbatches * self.num_stages  # after every activation's tags
        sums = []
        for name, peer, pair in self._tied:
            weight = self.get_parameter(name)
            grad = weight.grad
            link = Link(self._group, peer, base + pair, base + pair, [])
            flag = torch.tensor([grad is not None], dtype=torch.uint8,
                                device=self._group.comm_device(weight.device))
            link.post_send(flag)
            other_has = bool(link.receive(torch.empty_like(flag)).item())
            if grad is None and not other_has:
                _wait_all(link.pending)
                sums.append((weight, before[name]))
                continue
            mine = grad if grad is not None else torch.zeros_like(weight)
            link.post_send(mine.detach().contiguous())
            other = link.receive(torch.empty_like(mine))
            _wait_all(link.pending)
            step = mine + other if self._group.rank < peer else other + mine
            kept = before[name]
            sums.append((weight, step if kept is None else kept + step))
        for weight, total in sums:
            weight.grad = total

    def _check(self, inputs: Any, target: Any) -> str:
        called = [name for name, _ in self.stage_modules()]
        for name, _ in self._fsdp_modules:
            if not any(name == c or name.startswith(c + ".") for c in called):
                return (f"Pipeline.step: fully_shard was applied to "
                        f"{repr(name) if name else 'the pipeline itself'}, whose forward the "
                        f"step never calls (it calls the stages' modules directly); apply it "
                        f"to the modules of pipe.stage_modules() (or modules inside them)")
        if self.schedule == SPLIT and self._fsdp_modules:
            return (f"Pipeline.step: schedule={SPLIT!r} computes the weights' gradients "
                    f"apart from the backward that FSDP2 reduces them after; use "
                    f"schedule='1f1b' with fully_shard, or tensorpar.pipeline.average_gradients")
        if self.schedule == SPLIT and (hooked := next(
                (n for n, p in self.named_parameters() if has_post_accumulate_hooks(p)), None)):
            return (f"Pipeline.step: schedule={SPLIT!r} writes the weights' gradients into "
                    f".grad itself, apart from the backward, so hooks that run once a "
                    f"gradient is accumulated would not see them, and {hooked!r} has one "
                    f"(a BucketedAllReduce or tensorpar's DistributedDataParallel across "
                    f"replicas, register_post_accumulate_grad_hook): the replicas' gradients "
                    f"would not be averaged. Use schedule='1f1b', or "
                    f"tensorpar.pipeline.average_gradients after the step")
        if (planned := next((n for n, m in self.named_modules()
                             if _sequence_parallel(m)), None)) is not None:
            return (f"Pipeline.step: {planned!r} is planned with sequence parallelism, which "
                    f"a pipeline stage does not support yet: the activation crossing a stage "
                    f"boundary is this rank's slice of the sequence, and the next stage "
                    f"cannot tell how the sequence was split. Plan the model without "
                    f"sequence_parallel")
        if self._tied and self._fsdp_modules:
            return ("Pipeline.step: a parameter tied across stages (a tied embedding and LM "
                    "head) under fully_shard is not supported; untie it or shard the "
                    "replicas with tensorpar.pipeline.average_gradients")
        if self.is_first:
            if not isinstance(inputs, torch.Tensor):
                return (f"Pipeline.step: the first stage (rank {self._group.rank}) needs the "
                        f"batch as a tensor, got {type(inputs).__name__}")
            if inputs.dim() == 0 or inputs.shape[0] < self.microbatches:
                return (f"Pipeline.step: a batch of shape {tuple(inputs.shape)} cannot be cut "
                        f"into microbatches={self.microbatches} non-empty microbatches")
        if self.is_last:
            if not isinstance(target, torch.Tensor):
                return (f"Pipeline.step: the last stage (rank {self._group.rank}) needs "
                        f"target as a tensor, got {type(target).__name__}")
            if target.dim() == 0 or target.shape[0] < self.microbatches:
                return (f"Pipeline.step: a target of shape {tuple(target.shape)} cannot be "
                        f"cut into microbatches={self.microbatches} non-empty microbatches")
            if self.loss_fn is None and self._decoder is not None:
                head = self.get_submodule(self._decoder.head)
                shard = getattr(head, "shard", None)
                if getattr(head, "gather_output", True) is False and shard is not None \
                        and not shard.group.is_single:
                    return (f"Pipeline.step: the LM head {self._decoder.head!r} is "
                            f"vocab-parallel (each rank holds a slice of the logits), and the "
                            f"model's own loss reads whole logits; pass loss_fn built on "
                            f"tensorpar.nn.vocab_parallel_cross_entropy, or plan the model "
                            f"with plan_from_transformers(model, lm_head='gathered')")
        return ""

    def _check_model_inputs(self, given: dict[str, torch.Tensor]) -> str:
        """What is wrong with this rank's ``attention_mask`` / ``position_ids``, or ""."""
        rows = {t.shape[0] for t in given.values() if isinstance(t, torch.Tensor)}
        for name, t in given.items():
            if self._decoder is None:
                return (f"Pipeline.step: {name} is for a transformers causal LM; this "
                        f"pipeline's model is not one")
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                return f"Pipeline.step: {name} must be a tensor of shape (B, T), got {got}"
            if len(rows) > 1 or t.shape[0] < self.microbatches:
                return (f"Pipeline.step: {name} has {t.shape[0]} rows; expected the batch's "
                        f"(at least microbatches={self.microbatches}), the same for "
                        f"attention_mask and position_ids")
        return ""

    def _agree(self, problem: str, inputs: Any, target: Any,
               given: dict[str, torch.Tensor]) -> None:
        """Raise on every rank if any rank found a problem, or the ranks' rows differ.

        One small all-reduce (max) of ``[problem, batch rows, target rows]``, of which
        model inputs each rank gave, their rows and whether gradients are enabled, each
        with its negation (so the max also gives the min): the first stage gives the
        batch's rows, the last the target's, every rank its ``attention_mask`` /
        ``position_ids``, so all are compared everywhere.
        """
        rows_in = inputs.shape[0] if self.is_first and not problem else 0
        rows_target = target.shape[0] if self.is_last and not problem else 0
        which = sum(1 << i for i, name in enumerate(_MODEL_INPUTS) if name in given)
        rows_given = next(iter(given.values())).shape[0] if given and not problem else 0
        grads = int(torch.is_grad_enabled())
        flags = [1 if problem else 0, rows_in, rows_target, which, -which, rows_given,
                 -rows_given, grads, -grads]
        if self._group.size > 1:
            t = torch.tensor(flags, dtype=torch.int64,
                             device=self._group.comm_device(self._device()))
            all_reduce(t, torch_op("max"), self._group)  # (a peer gone: PeerLostError)
            flags = [int(v) for v in t.tolist()]
            if flags[0] and not problem:
                problem = "Pipeline.step: another rank of the pipeline got invalid inputs"
        if not problem and flags[7] != -flags[8]:
            # a stage without them sends activations that need no gradient, which the next
            # reads as unused (no gradient back, silently), or takes no part in the backward
            problem = ("Pipeline.step: gradients enabled on some ranks only (torch.no_grad() "
                       "or inference_mode around step on some of them); enable them on "
                       "every rank or on none")
        if not problem and flags[1] != flags[2]:
            problem = (f"Pipeline.step: the first stage got a batch of {flags[1]} rows and the "
                       f"last stage a target of {flags[2]} rows; expected the same")
        names = " and ".join(given) or "attention_mask / position_ids"
        if not problem and flags[3] != -flags[4]:
            problem = (f"Pipeline.step: {names} given on some ranks only; every stage's "
                       f"forward needs them: give them on every rank")
        elif not problem and flags[3] and (flags[5] != -flags[6] or flags[5] != flags[1]):
            problem = (f"Pipeline.step: {names} has {rows_given} rows on this rank "
                       f"({-flags[6]} to {flags[5]} over the ranks) and the batch {flags[1]}; "
                       f"expected the batch's rows everywhere")
        if problem:
            raise CollectiveArgumentError(problem)

    def _targets(self, target: torch.Tensor) -> tuple[list[Any], list[Any]]:
        """Each microbatch's target and the weight of its loss in the batch loss."""
        parts = list(torch.tensor_split(target, self.microbatches))
        if self.loss_fn is None:  # the model's own loss: a sum over label tokens / their count
            count = (target[..., 1:] != -100).sum()
            return parts, [count] * len(parts)
        if self.loss_reduction == "sum":  # added up as they are
            return parts, [1.0] * len(parts)
        return parts, [p.shape[0] / target.shape[0] for p in parts]

    def _loss(self, output: torch.Tensor, target: Any, weight: Any) -> torch.Tensor:
        if self.loss_fn is None:
            assert self._decoder is not None
            loss: torch.Tensor = self._loss_function(
                logits=output, labels=target, vocab_size=self._decoder.model.config.vocab_size,
                num_items_in_batch=weight)
            return loss
        loss = self.loss_fn(output, target) * weight
        return loss


class _Received(NamedTuple):
    """A received activation: where its backward ends, its receive's node, its metadata."""

    edge: GradientEdge
    node: Any
    meta: Meta


class StepFailed(TensorparError):
    """Another rank of the pipeline raised during this `Pipeline.step` (its error says why).

    Raised on the ranks that finished their part of the step, so that no rank goes on as
    if the step had succeeded. Also raised, before any transfer, by every later step on a
    process group where a failed step left sends in flight (receives not posted ahead).
    """


_LEFT_IN_FLIGHT: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
"""Process groups a failed step left sends on (where receives are not posted ahead)."""


def _anchor_of(done: TensorPlaceholder) -> tuple[torch.Tensor, torch.Tensor]:
    """The sent activation's anchor in this rank's graph, and the gradient it takes."""
    anchor = done._anchor
    assert anchor is not None
    return anchor, torch.zeros_like(anchor)


def _backend(g: Group) -> str:
    try:
        return str(dist.get_backend(g.handle))
    except (RuntimeError, ValueError):  # pragma: no cover - no backend to ask
        return ""


_FACTS = ("microbatches", "schedule", "virtual_stages", "loss_reduction", "loss_fn given",
          "tensorpar's wire format", "the blocks of each stage (split, or the model's blocks)",
          "the model's layers and parameters (classes, settings, names, shapes, dtypes)")
"""What every rank's `pipeline` call must agree on (compared before anything is cut)."""


def _cut(model: nn.Module, g: Group, microbatches: int, schedule: str,
         loss_fn: LossFn | None, virtual_stages: int, split: Sequence[int] | None,
         loss_reduction: str) -> tuple[list[StageSpec], list[list[Action]], bool,
                                       dict[int, list[tuple[int, str]]]]:
    """`pipeline`'s arguments checked on this rank.

    Returns the stages, the schedule's rows, whether ``model`` is a transformers causal LM
    (cut by decoder layers), and its parameters tied across ranks (`tied_parameters`).
    """
    fn = "pipeline"
    for name, value in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CollectiveArgumentError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    if schedule not in SCHEDULES:
        raise CollectiveArgumentError(
            f"{fn}: schedule={schedule!r} is not known; expected one of {SCHEDULES}")
    if schedule == SPLIT and not supported():
        raise CollectiveArgumentError(
            f"{fn}: schedule={SPLIT!r} needs torch 2.5 or later (a backward that starts "
            f"from a node of the graph); this is torch {torch.__version__}")
    if loss_reduction not in ("mean", "sum"):
        raise CollectiveArgumentError(
            f"{fn}: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if loss_fn is None and loss_reduction != "mean":
        raise CollectiveArgumentError(
            f"{fn}: loss_reduction={loss_reduction!r} applies to a loss_fn; the model's "
            f"own loss (loss_fn=None) is weighed by its label tokens")
    hf = is_transformers(model) and not has_blocks(model)
    if loss_fn is None and not hf:
        raise CollectiveArgumentError(
            f"{fn}: {type(model).__name__} needs loss_fn=(output, target) -> loss; only "
            f"a transformers causal LM brings its own loss")
    if hf and getattr(model.config, "output_router_logits", False):
        raise CollectiveArgumentError(
            f"{fn}: {type(model).__name__} has config.output_router_logits=True: its "
            f"load-balancing loss is computed over every layer's router logits together, "
            f"which the stages hold apart (the model's own loss would leave it out, and "
            f"its forward would look for the logits of layers this rank does not run); "
            f"set it to False")
    specs = stage_specs(model, g.size * virtual_stages, split)
    rows = build_schedule(schedule, g.size, microbatches, virtual_stages)
    if g.size > 1 and not in_order(rows, g.size) and "gloo" not in _backend(g):
        even = -(-microbatches // g.size) * g.size
        fix = f"use a number of microbatches divisible by {g.size}" \
            if in_order(build_schedule(schedule, g.size, even, virtual_stages), g.size) \
            else "use 3 or more ranks, virtual_stages=1 or schedule='1f1b'"
        raise CollectiveArgumentError(
            f"{fn}: with {g.size} ranks, virtual_stages={virtual_stages} and "
            f"microbatches={microbatches}, activations and gradients travel the same way "
            f"between two ranks in an order the receiver cannot follow without tags, "
            f"which the {_backend(g)!r} backend ignores; {fix}")
    return specs, rows, hf, tied_parameters(model, specs, g.size)


def pipeline(model: nn.Module, *, group: GroupLike = None, microbatches: int,
             schedule: str = "1f1b", loss_fn: LossFn | None = None, virtual_stages: int = 1,
             split: Sequence[int] | None = None, loss_reduction: str = "mean") -> Pipeline:
    """Cut ``model`` into pipeline stages over ``group``; keep this rank's, return the pipeline.

    Every rank builds the same dense model and calls this; the modules of other ranks'
    stages are deleted from ``model`` (in place). Stage ``k`` of ``P * virtual_stages``
    runs on group rank ``k % P`` (round-robin). Stages are contiguous runs of blocks: an
    ``nn.Sequential``'s blocks, or a transformers causal LM's decoder layers (the
    embedding joins the first stage, the final norm and the LM head the last). Uneven
    counts are balanced like ``torch.tensor_split`` (7 blocks on 3 stages: 3, 2, 2).
    Any other model may list its own blocks: a method ``pipeline_blocks()`` returning, in
    order, pairs ``(names, fn)``: the dense names of the modules and parameters the block
    holds, and the function that runs it (``x = fn(x)``); the first block takes the batch,
    the last gives ``loss_fn``'s input. A parameter that blocks on two ranks hold (a tied
    embedding) has its two gradients summed after each step.

    Args:
        model: an ``nn.Sequential``, a transformers causal LM of a family in
            ``tensorpar.pipeline.stages.HF_MODEL_TYPES`` (102 families: Llama, Mistral,
            Qwen, Gemma, Phi, Granite, DeepSeek, Jamba...) or a model with
            ``pipeline_blocks()`` (parallelize such a model before this call: its
            functions are taken now).
        group: the pipeline's process group (``None``: the default group, resolved at
            call time); group rank 0 runs the first stage.
        microbatches: microbatches per step (the batch is split like ``tensor_split``:
            they need not divide it).
        schedule: ``"gpipe"``, ``"1f1b"`` (interleaved 1F1B when ``virtual_stages > 1``) or
            ``"zero-bubble"`` (ZB-H1: each backward split into the input's gradient and
            the weights', run later where the rank would wait; interleaved too when
            ``virtual_stages > 1``; see `tensorpar.pipeline.split_backward` for what it
            costs and does not run).
        loss_fn: ``(output, target) -> loss`` of a microbatch, mean-reduced over its rows
            (see ``loss_reduction``); ``None`` for a transformers model: its own causal-LM
            loss (``labels``).
        virtual_stages: stages per rank (interleaving).
        split: blocks (decoder layers) per stage, ``P * virtual_stages`` of them.
        loss_reduction: ``"mean"``: ``loss_fn`` is a mean over the microbatch's rows, and
            the batch loss weighs each by its share of the rows; ``"sum"``: the
            microbatches' losses are added up as they are (``loss_fn`` a sum, or a sum
            divided by a count over the whole batch, such as its targets not ignored).

    Returns:
        The `Pipeline`: call ``step(inputs, target)`` on every rank.

    Raises:
        CollectiveArgumentError: bad counts, an unknown schedule or ``loss_reduction``, a
            split that does not add up, or an ``nn.Sequential`` without ``loss_fn``; the
            ranks' calls differ (arguments, the blocks of each stage, the model's
            parameter names, shapes or dtypes: compared on every rank before anything is
            cut); another rank's call was refused.
        CollectiveTypeError: a model of none of these kinds, or ``pipeline_blocks()``
            items that are not ``(names, fn)`` with names of the model's. (Any error of
            this rank's call raises `CollectiveArgumentError` on the group's other ranks.)

    Shape:
        ``inputs``: ``(B, *)`` on the first stage; ``target``: ``(B, *)`` on the last;
        microbatch ``i`` takes rows ``tensor_split(range(B), microbatches)[i]``.

    Example:
        >>> import torch, tensorpar
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
        >>> pipe = tensorpar.nn.pipeline(model, microbatches=2,
        ...                              loss_fn=torch.nn.functional.mse_loss)
        >>> loss = pipe.step(torch.ones(5, 3), torch.zeros(5, 3))  # one process: one stage
        >>> names = [name for name, _ in pipe.named_parameters()]  # the dense names
        >>> print(names[:2])
        ['0.weight', '0.bias']
    """
    return Pipeline(model, group=group, microbatches=microbatches, schedule=schedule,
                    loss_fn=loss_fn, virtual_stages=virtual_stages, split=split,
                    loss_reduction=loss_reduction)


def _outside_autocast(device: torch.device) -> contextlib.ExitStack[bool | None]:
    """Autocast off where the caller turned it on (for ``device``'s type and the CPU).

    A step called under autocast runs its backwards as a dense loop runs
    ``loss.backward()``: after the autocast block. (An activation checkpoint recomputes
    under the autocast state of its forward, which it restores itself.)
    """
    stack = contextlib.ExitStack()
    for kind in dict.fromkeys((device.type, "cpu")):
        if torch.is_autocast_enabled(kind):
            stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


def _in_flight(pending: list[Any], inbox: Inbox | None) -> list[tuple[Any, Any]]:
    """A step's sends and the receives its inbox still has posted."""
    return [*pending, *(inbox.in_flight() if inbox is not None else [])]


def _wait_all(works: list[tuple[Any, Any]] | None) -> None:
    """Wait for each of ``works`` (``(work, tensors)``) not yet waited for.

    (A gloo receive waited for twice waits for a second message: each is waited once.)
    """
    for work, _ in works or []:
        if not work.is_completed():
            work.wait()


def _sequence_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a tensor-parallel layer planned with sequence parallelism.

    Read by its ``sequence`` layout (`tensorpar.nn.sequence.SequenceShards`), named rather
    than imported: the ``nn`` package builds on this one.
    """
    layout = getattr(module, "sequence", None)
    return type(layout).__name__ == "SequenceShards" and \
        type(layout).__module__ == "tensorpar.nn.sequence"
