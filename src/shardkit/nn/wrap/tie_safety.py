"""Which sub-modules :func:`~shardkit.nn.wrap.auto_wrap` may not wrap on their own: those that would split a tie.

A parameter registered on several modules (an embedding tied to the output projection) must stay in one unit, or
each unit shards its own copy and the copies drift apart from the second step on. The same holds for a sub-module
registered under two different parents. So a module is *blocked* when it contains some, but not all, users of a
tied parameter (or some, but not all, parents of a shared sub-module); the parameter then stays with the smallest
module around every user, which is wrapped (or left to the root's unit) as a whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass
class _Graph:
    """The module tree under the ``auto_wrap`` root as a graph (a module may have several parents)."""

    modules: dict[int, nn.Module] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)  # first path a module was reached under
    parents: dict[int, set[int]] = field(default_factory=dict)
    users: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # id(param) -> (id(module), attr)


def _build_graph(root: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> _Graph:
    graph = _Graph()
    graph.modules[id(root)] = root
    graph.paths[id(root)] = ""
    graph.parents[id(root)] = set()
    queue = deque([root])  # breadth first: each module is named by its shortest path, in definition order
    while queue:
        module = queue.popleft()
        if is_wrapped(module):
            continue  # a wrapper owns its parameters; only its place in the tree matters
        for attr, param in module._parameters.items():
            if param is not None:
                graph.users.setdefault(id(param), []).append((id(module), attr))
        prefix = graph.paths[id(module)]
        for name, child in module._modules.items():
            if child is None:
                continue
            if id(child) not in graph.paths:
                graph.modules[id(child)] = child
                graph.paths[id(child)] = f"{prefix}.{name}" if prefix else name
                graph.parents[id(child)] = set()
                queue.append(child)
            graph.parents[id(child)].add(id(module))
    return graph


def _ancestors(node: int, parents: Mapping[int, set[int]], memo: dict[int, frozenset[int]]) -> frozenset[int]:
    """``node`` and every module whose subtree contains it."""
    if node in memo:
        return memo[node]
    found = {node}
    pending = list(parents[node])
    while pending:
        current = pending.pop()
        if current not in found:
            found.add(current)
            pending.extend(parents[current])
    memo[node] = frozenset(found)
    return memo[node]


def _split_by(members: Iterable[int], parents: Mapping[int, set[int]], memo: dict[int, frozenset[int]]) -> set[int]:
    """Modules that contain some but not all of ``members``: wrapping one of them would split the group."""
    ancestor_sets = [_ancestors(m, parents, memo) for m in members]
    return set(frozenset.union(*ancestor_sets) - frozenset.intersection(*ancestor_sets))


def blocked_modules(root: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> dict[int, str]:
    """``id(module) -> why`` for every module under ``root`` that must not become a unit of its own.

    ``why`` names the module and the tie, e.g. ``"'embed' (Embedding): parameter 'embed.weight' is also
    'head.weight'"``. ``root`` is never blocked: users outside it are out of sight here (the FSDP constructor
    catches those splits).
    """
    graph = _build_graph(root, is_wrapped)
    memo: dict[int, frozenset[int]] = {}
    blocked: dict[int, str] = {}
    for uses in graph.users.values():
        modules = {m for m, _ in uses}
        if len(modules) < 2:
            continue
        names = [f"'{_join(graph.paths[m], attr)}'" for m, attr in uses]
        for module in _split_by(modules, graph.parents, memo):
            blocked.setdefault(module, f"{_name(graph, module)}: parameter {names[0]} is also {', '.join(names[1:])}")
    for node, parents in graph.parents.items():
        if len(parents) < 2:
            continue
        names = sorted(f"'{graph.paths[p]}'" if graph.paths[p] else "the root" for p in parents)
        for module in _split_by(parents, graph.parents, memo):
            blocked.setdefault(
                module, f"{_name(graph, module)}: sub-module '{graph.paths[node]}' is shared by {', '.join(names)}"
            )
    blocked.pop(id(root), None)
    return blocked


def _name(graph: _Graph, module: int) -> str:
    return f"'{graph.paths[module]}' ({type(graph.modules[module]).__name__})"


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


__all__ = ["blocked_modules"]
