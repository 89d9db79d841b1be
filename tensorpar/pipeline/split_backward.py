"""One backward pass in two halves: the input's gradient now, the weights' gradients later.

A zero-bubble schedule runs a stage's backward as *B*, the gradient of the stage's input
(the previous stage waits for it), and *W*, the gradients of the stage's parameters
(nobody waits for them), in time the rank would otherwise spend idle. Autograd holds one
graph per microbatch; the two halves come from where the parameters meet it:

- the *activation path*: the nodes between the output and the input (every node from which
  the input's node can be reached);
- a weight's *boundary*: the nodes of the activation path its gradient leaves from (the
  matmul's node for a linear layer's weight), met walking from the weight towards the
  output; weights that share a boundary node form one group. The weights are the graph's
  leaves off the activation path: the parameters, and any other tensor that needs a
  gradient (a temperature a loss function holds).

`backward_input` runs the graph from the output to the input only (``autograd.grad`` with
the input as its target: torch's own nodes skip the gradients no one asked for, so a matmul
computes its input's gradient and not its weight's) while hooks keep what reaches each
boundary node. `WeightGrads.run` then runs, per group, the graph from its boundary nodes
(with what was kept) to its weights, and adds the results to ``.grad``. The numbers are
one backward pass's.

Costs and limits:

- the graph is kept (``retain_graph``) from B to W, so a microbatch's activations live
  until its W;
- some work runs twice, and the copy is discarded: a custom ``autograd.Function`` on the
  boundary (one that takes a weight itself) cannot tell which gradients were asked for
  and computes all of them in both halves; a weight used at two places on the activation
  path has the backward of the nodes between them run again in W; a block under a
  non-reentrant activation checkpoint is recomputed in B and again in W;
- gradients reach ``.grad`` by assignment: hooks that run when autograd accumulates a
  gradient (``register_post_accumulate_grad_hook``, FSDP2's) do not run;
- without a differentiable input (the first stage: token ids, or a batch that needs no
  gradient) there is nothing to split at, and no one waits for the input's gradient:
  B does nothing and W runs the whole backward;
- a reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``,
  transformers' default) runs a backward of its own inside the graph, which cannot start
  from a node: a microbatch whose graph holds one runs its whole backward in B, W empty
  (right, not split; ``use_reentrant=False`` splits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGrads", "backward_input", "supported"]

SUPPORTED = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
_REENTRANT = "CheckpointFunctionBackward"  # torch.utils.checkpoint(use_reentrant=True)


def supported() -> bool:
    """Whether ``autograd.grad`` can start from a `GradientEdge` here (torch 2.5 and later)."""
    return SUPPORTED


@dataclass(eq=False)
class _Group:
    """Parameters whose gradients leave the activation path at the same nodes."""

    params: list[torch.Tensor]
    nodes: list[Node]
    edges: list[GradientEdge]  # where each parameter's gradient arrives (its accumulator)
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class WeightGrads:
    """The W half of one backward: `run` adds the parameters' gradients to ``.grad`` once.

    Holds the graph (and so the microbatch's activations) until it has run. ``whole``:
    an output and its gradient whose whole backward is deferred to `run` (no input to
    split at).
    """

    groups: list[_Group] = field(default_factory=list)
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def run(self) -> None:
        """Compute each group's gradients from what its boundary nodes kept; add to ``.grad``."""
        groups, self.groups = self.groups, []
        whole, self.whole = self.whole, None
        if whole is not None:
            torch.autograd.backward(whole[0], whole[1])
        for group in groups:
            _run_group(group)


def backward_input(output: torch.Tensor, grad: torch.Tensor | None,
                   inputs: Sequence[GradientEdge]) -> WeightGrads:
    """The B half of ``output``'s backward (gradient ``grad``) down to ``inputs``.

    Runs every node between ``output`` and ``inputs`` (a receive's backward there sends
    the gradient on), none that only leads to a weight (a leaf that needs a gradient).
    Returns the W half. With no ``inputs`` (or none in the graph) it runs nothing: the W
    half is the whole backward.
    """
    root = output.grad_fn
    if root is None:
        return WeightGrads()
    consumers, leaves = _consumers(root)
    if any(node.name() == _REENTRANT for node in consumers):
        # a reentrant checkpoint's node runs a backward of its own, which autograd.grad
        # refuses: the whole backward now (the input's gradient leaves with it), W empty
        torch.autograd.backward(output, grad)
        return WeightGrads()
    path = _activation_path([e.node for e in inputs], consumers)
    if not path:
        return WeightGrads(whole=(output, grad))
    groups = _groups(leaves, path, {e.node for e in inputs}, consumers)
    handles = [node.register_prehook(_keep(group, node))
               for group in groups for node in group.nodes]
    try:
        torch.autograd.grad(output, [e for e in inputs if e.node in path],
                            grad_outputs=grad, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return WeightGrads(groups)


def _consumers(root: Node) -> tuple[dict[Node, list[Node]], dict[Node, torch.Tensor]]:
    """Every node of the graph under ``root``, with the nodes that take its gradient.

    Also each leaf's gradient accumulator in the graph, with its leaf.
    """
    consumers: dict[Node, list[Node]] = {root: []}
    leaves: dict[Node, torch.Tensor] = {}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
                leaf = getattr(child, "variable", None)  # an accumulator: its leaf
                if leaf is not None:
                    leaves[child] = leaf
            consumers[child].append(node)
    return consumers, leaves


def _activation_path(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which one of ``starts`` can be reached (``starts`` included)."""
    path = {n for n in starts if n in consumers}
    queue = deque(path)
    while queue:
        for parent in consumers[queue.popleft()]:
            if parent not in path:
                path.add(parent)
                queue.append(parent)
    return path


def _groups(leaves: dict[Node, torch.Tensor], path: set[Node], ends: set[Node],
            consumers: dict[Node, list[Node]]) -> list[_Group]:
    """Each weight's boundary on the activation path; weights sharing one, grouped.

    A boundary stops short of ``ends`` (the inputs): what lies below an input is not this
    backward's (its gradient is returned there).
    """
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    for start, p in leaves.items():
        if start in path:  # the input's own leaf (a receive's anchor)
            continue
        boundary: list[Node] = []
        seen = {start}
        queue = deque([start])
        while queue:
            for parent in consumers[queue.popleft()]:
                if parent in seen:
                    continue
                seen.add(parent)
                (boundary.append if parent in path else queue.append)(parent)
        boundary = [n for n in boundary if n not in ends]
        if not boundary:
            continue
        mine = _Group([p], boundary, [GradientEdge(start, 0)])
        for other in {id(g): g for g in (owner.get(n) for n in boundary) if g}.values():
            mine.params.extend(other.params)
            mine.edges.extend(other.edges)
            mine.nodes.extend(n for n in other.nodes if n not in mine.nodes)
            groups.remove(other)
        for node in mine.nodes:
            owner[node] = mine
        groups.append(mine)
    return groups


def _keep(group: _Group, node: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.kept[node] = grad_outputs
    return hook


def _run_group(group: _Group) -> None:
    outputs: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    for node in group.nodes:
        for i, g in enumerate(group.kept.get(node, ())):
            if g is not None:
                outputs.append(GradientEdge(node, i))
                grads.append(g)
    if not outputs:
        return
    # a boundary node below another in this group gets its gradient from B again, not
    # the share that flows down from the upper one (already in what B kept)
    handles = [node.register_prehook(_replace(group.kept[node]))
               for node in group.nodes if node in group.kept] if len(group.nodes) > 1 else []
    try:
        found = torch.autograd.grad(outputs, group.edges,
                                    grad_outputs=grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        for p, g in zip(group.params, found, strict=True):
            if g is None:
                continue
            if p.grad is None:  # a tensor of its own, as autograd's accumulator makes:
                # the result may be shared (x + p1 + p2), a broadcast view (p.sum()) or
                # the input's gradient on its way to the previous stage
                p.grad = g.clone(memory_format=torch.contiguous_format)
            else:
                p.grad += g


def _replace(kept: tuple[torch.Tensor | None, ...]) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return kept
    return hook
