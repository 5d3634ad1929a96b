"""One micro-batch's backward on a stage, in two halves: input gradients now (B), weight gradients later (W).

The zero-bubble schedules send the gradients of a stage's inputs upstream as soon as they exist and compute
the parameters' gradients later, in what would otherwise be idle time. Nothing of the forward is recomputed:
both halves run on the autograd graph the forward saved.

How the graph is cut. Call the graph's nodes that lie on a path from a root (a tensor this stage sent on, or
the loss) to a received input the *input side*. B runs exactly those nodes (``torch.autograd.grad`` towards
the received inputs, keeping the graph), so each of them gets its full incoming gradient, which a hook
records on the *boundary* nodes: input-side nodes with an edge leaving the input side towards a leaf (a
parameter, or an input the user made require grad). W then runs, from each boundary node and its recorded
gradient, only the nodes towards those leaves; a root that never reaches an input starts W with its own
gradient. A leaf's gradient goes through its ``AccumulateGrad`` node, so ``.grad`` hooks (the data-parallel
all-reduce, gradient-as-bucket-view) fire in W as they would in an unsplit backward.

Boundaries whose weight-side subgraphs share a node (a weight used twice on the stage) run in one W call, so
the shared node adds its contributions once, as the unsplit backward does; inside such a call the boundaries'
gradients are pinned to the recorded ones, because their input-side edges would otherwise deliver them a
second time. Separate calls for separate weights keep W from re-running the input side.

The split is refused (:func:`backward_input` returns a reason; the caller then runs the unsplit backward) when
a custom ``autograd.Function`` would have to run in both halves: its backward may compute or consume the
weight gradient once, which W cannot repeat safely. A ``torch.compile``-d module is one such Function (its whole
backward is one node), so a compiled stage runs unsplit. ``torch.utils.checkpoint`` (non-reentrant) inside a
stage splits exactly, but every W call that reaches the checkpointed block recomputes it once more; modules
given to ``smp.set_activation_checkpointing`` make their stage run unsplit instead (see ``StageExecution``).

Memory. B keeps the graph for W, but where the forward ran under a
:class:`~shardkit.modelparallel.pipeline.saved_activations.SavedActivations`' hooks, the tensors only B needed are
released as B ends; W holds on to the recorded boundary gradients until it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Callable, Optional, Union

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from shardkit.modelparallel.pipeline.saved_activations import SavedActivations

Grads = tuple[Optional[torch.Tensor], ...]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(starts: Sequence[Node]) -> list[Node]:
    """Every node reachable from ``starts``, each after all of its children (iterative: graphs are deep)."""
    order: list[Node] = []
    seen: set[Node] = set()
    for start in starts:
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(_children(start)))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(_children(child))))
    return order


def _is_leaf_node(node: Node) -> bool:
    return type(node).__name__ == "AccumulateGrad"


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, node: Node) -> Node:
        self.parent.setdefault(node, node)
        while self.parent[node] is not node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a: Node, b: Node) -> None:
        self.parent[self.find(a)] = self.find(b)


class WeightGradients:
    """The W half of one micro-batch's backward: run it once with :meth:`run` (then the graph is released)."""

    def __init__(
        self,
        groups: list[list[Node]],
        targets: list[list[torch.Tensor]],
        captured: dict[Node, Grads],
        root_grads: dict[Node, list[tuple[int, torch.Tensor]]],
        saved: Optional[SavedActivations] = None,
    ) -> None:
        self._groups = groups
        self._targets = targets
        self._captured = captured
        self._root_grads = root_grads
        self._saved = saved
        grads = [g for gs in captured.values() for g in gs if g is not None]
        self._held = saved.hold(grads + [g for gs in root_grads.values() for _, g in gs]) if saved else []

    def run(self) -> None:
        """Accumulate every leaf's gradient of this micro-batch into its ``.grad`` (firing its hooks)."""
        for starts, targets in zip(self._groups, self._targets):
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node in starts:
                for i, grad in enumerate(self._captured.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
                for i, grad in self._root_grads.get(node, []):
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
            if not edges:
                continue
            pinned = [n for n in starts if n in self._captured]
            handles = []
            if len(pinned) > 1:  # each boundary's gradient is exactly what B recorded, never added to again
                handles = [n.register_prehook(lambda _, saved=self._captured[n]: saved) for n in pinned]
            try:
                torch.autograd.backward(edges, grads, inputs=targets, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()
        self._groups, self._targets, self._captured, self._root_grads = [], [], {}, {}
        if self._saved is not None:
            self._saved.drop(self._held)
            self._held = []


def backward_input(
    tensors: Sequence[torch.Tensor],
    grad_tensors: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    saved: Optional[SavedActivations] = None,
) -> Union[tuple[list[Optional[torch.Tensor]], WeightGradients], str]:
    """B: the gradients of ``inputs`` (leaves) from ``tensors`` seeded with ``grad_tensors``, and the W work left.

    Returns a reason string instead, computing nothing, where the backward cannot be split (see the module
    docstring); the caller then runs the whole backward at once. ``saved``: the hooks the forward ran under,
    whose B-only tensors are released when B ends (and which counts the gradients kept for W).
    """
    roots = [get_gradient_edge(t) for t in tensors]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    order = _post_order([edge.node for edge in roots])
    input_side: set[Node] = set()
    weight_side: set[Node] = set()  # reaches a leaf other than the received inputs
    for node in order:
        children = _children(node)
        if node in input_nodes or any(c in input_side for c in children):
            input_side.add(node)
        if (_is_leaf_node(node) and node not in input_nodes) or any(c in weight_side for c in children):
            weight_side.add(node)
    boundaries = [
        n for n in order if n in input_side and any(c not in input_side and c in weight_side for c in _children(n))
    ]
    for node in order:
        if isinstance(node, BackwardCFunction) and node in input_side and node in weight_side:
            return (
                f"custom autograd.Function {type(node).__name__} lies on both the input and the weight gradients' "
                "paths, and its backward cannot be run in two halves"
            )
    root_grads: dict[Node, list[tuple[int, torch.Tensor]]] = {}
    for edge, grad in zip(roots, grad_tensors):
        if edge.node not in input_side and edge.node in weight_side:
            root_grads.setdefault(edge.node, []).append((edge.output_nr, grad))
    groups, targets = _group(boundaries, list(root_grads), input_side, weight_side)
    captured: dict[Node, Grads] = {}
    handles = [n.register_prehook(_recorder(captured, n)) for n in boundaries]
    try:
        needed = [(i, x) for i, x in enumerate(inputs) if get_gradient_edge(x).node in input_side]
        found: list[Optional[torch.Tensor]] = [None] * len(inputs)
        if needed:
            keep = _rerun_by_w(groups, input_side) if saved is not None else []
            with saved.freeing_after(keep) if saved is not None else nullcontext():
                grads = torch.autograd.grad(
                    list(tensors), [x for _, x in needed], list(grad_tensors), retain_graph=True, allow_unused=True
                )
            for (i, _), grad in zip(needed, grads):
                found[i] = grad
    finally:
        for handle in handles:
            handle.remove()
    return found, WeightGradients(groups, targets, captured, root_grads, saved)


def _rerun_by_w(groups: list[list[Node]], input_side: set[Node]) -> list[Node]:
    """The input-side nodes W runs again: every boundary, and, in a group of several (a weight used twice),
    the input-side nodes below its starts, through which one start's gradient reaches the shared weight."""
    nodes = {start for starts in groups for start in starts if start in input_side}
    for starts in groups:
        if len(starts) > 1:
            nodes.update(n for n in _post_order(starts) if n in input_side)
    return list(nodes)


def _recorder(captured: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def record(grad_outputs: Grads) -> None:
        captured[node] = tuple(grad_outputs)

    return record


def _group(
    boundaries: list[Node], roots: list[Node], input_side: set[Node], weight_side: set[Node]
) -> tuple[list[list[Node]], list[list[torch.Tensor]]]:
    """W's starts in groups whose weight-side subgraphs share no node, and each group's leaves."""
    owner: dict[Node, Node] = {}
    sets = _UnionFind()
    for start in [*boundaries, *roots]:
        sets.find(start)
        first = [start] if start in roots else [c for c in _children(start) if c not in input_side]
        stack = [c for c in first if c in weight_side]
        while stack:
            node = stack.pop()
            if node in owner:
                sets.union(start, owner[node])
                continue
            owner[node] = start
            stack += [c for c in _children(node) if c in weight_side]
    groups: dict[Node, list[Node]] = {}
    for start in [*boundaries, *roots]:
        groups.setdefault(sets.find(start), []).append(start)
    leaves: dict[Node, list[torch.Tensor]] = {key: [] for key in groups}
    for node, start in owner.items():
        if _is_leaf_node(node):
            leaves[sets.find(start)].append(node.variable)  # type: ignore[attr-defined]
    keys = [k for k in groups if leaves[k]]
    return [groups[k] for k in keys], [leaves[k] for k in keys]
