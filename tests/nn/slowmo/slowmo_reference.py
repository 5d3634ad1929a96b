"""A single-process simulation of SlowMo's equations (its own checks are in ``test_slowmo_reference.py``).

The simulation keeps one parameter vector (and push-sum weight) per *node* and applies, step by step, exactly the
equations the wrapper documents: local SGD steps on node-averaged gradients taken at ``x / w``; LocalSGD's exact
average every ``localsgd_frequency`` steps; push-sum / push-pull gossip along the graph's edges of each round
(messages applied in the same step, or one step later with overlap); and the slow-momentum step every
``slowmo_frequency`` steps. It shares no code with the implementation except the graph's phone book (the
topology is an input; graphs have their own unit tests). Parity tests compare every rank against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn.slowmo import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    GraphManager,
    MixingManager,
    MixingShares,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    SlowMoBaseAlgorithm,
    UniformMixing,
)


class StarGraph(GraphManager):
    """Not regular: every node sends to node 0, and node 0 to node 1 (weights drift away from 1)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            self._add_peers(rank, [1 if rank == 0 else 0])

    def is_bipartite_graph(self) -> bool:
        return False

    def is_passive(self, rank: Optional[int] = None) -> bool:
        return False

    def is_dynamic_graph(self) -> bool:
        return False


class SkewedMixing(MixingManager):
    """Column-stochastic but not uniform: node ``i`` keeps ``0.3 + 0.2 * (i % 3)``."""

    def is_uniform(self) -> bool:
        return False

    def shares(self, out_peers: list[int]) -> MixingShares:
        keep = 0.3 + 0.2 * (self.graph_manager.rank % 3)
        return MixingShares(keep, {p: (1 - keep) / len(out_peers) for p in out_peers})


GRAPHS: dict[str, Callable[[int, int], GraphManager]] = {
    "default": lambda r, n: NPeerDynamicDirectedExponentialGraph(r, n),
    "npdde": lambda r, n: NPeerDynamicDirectedExponentialGraph(r, n),
    "npdde2": lambda r, n: NPeerDynamicDirectedExponentialGraph(r, n, peers_per_itr=2 if n > 2 else 1),
    "ring": lambda r, n: RingGraph(r, n),
    "dde": lambda r, n: DynamicDirectedExponentialGraph(r, n),
    "bipartite_exp": lambda r, n: DynamicBipartiteExponentialGraph(r, n),
    "bipartite_lin": lambda r, n: DynamicBipartiteLinearGraph(r, n),
    "star": lambda r, n: StarGraph(r, n),
}


@dataclass(frozen=True)
class Case:
    """One configuration, as wrapper arguments and as simulator input."""

    name: str
    algorithm: str = "localsgd"
    steps: int = 8
    lr: float = 0.1
    localsgd_frequency: int = 2
    slowmo_frequency: int = 4
    slowmo_lr: float = 1.0
    slowmo_momentum: float = 0.0
    memory_efficient: bool = False
    num_shards: int = 32
    push_sum: bool = True
    graph: str = "npdde"
    skewed: bool = False
    overlap: bool = False
    average_params: bool = False

    def wrapper_kwargs(self, node_rank: int, num_nodes: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            slowmo_base_algorithm=SlowMoBaseAlgorithm(self.algorithm),
            localsgd_frequency=self.localsgd_frequency,
            slowmo_frequency=self.slowmo_frequency,
            slowmo_lr=self.slowmo_lr,
            slowmo_momentum=self.slowmo_momentum,
            slowmo_memory_efficient=self.memory_efficient,
            slowmo_num_shards=self.num_shards,
            push_sum=self.push_sum,
            overlap=self.overlap,
            slowmo_sgp_average_params=self.average_params,
        )
        if self.algorithm == "sgp" and num_nodes > 1 and self.graph != "default":
            graph = GRAPHS[self.graph](node_rank, num_nodes)
            kwargs["graph"] = graph
            kwargs["mixing"] = SkewedMixing(graph) if self.skewed else UniformMixing(graph)
        return kwargs


class PlainSGD:
    """``p <- p - lr * grad``, the update ``torch.optim.SGD`` makes without momentum.

    The multi-process jobs use it because the first ``torch.optim`` optimizer in a process imports
    ``torch._dynamo`` (several seconds per worker); SlowMo only reads ``param_groups`` from an optimizer.
    """

    def __init__(self, params: Any, lr: float) -> None:
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@dataclass
class _NodeState:
    x: torch.Tensor
    w: float = 1.0
    pending: list[tuple[torch.Tensor, float]] = field(default_factory=list)


def _grad(model: nn.Module, params: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    model.zero_grad(set_to_none=True)
    x, y = make_batch(rank, step)
    F.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _local_step(case: Case, model: nn.Module, node: _NodeState, ranks: list[int], step: int) -> None:
    z = node.x / node.w if node.w != 1.0 else node.x.clone()
    grads = [_grad(model, z, r, step) for r in ranks]
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    g = total / len(ranks) if len(ranks) > 1 else total
    x = z * node.w if node.w != 1.0 else z
    node.x = x.add(g, alpha=-case.lr)


def _gossip_round(case: Case, nodes: list[_NodeState], round_index: int, graphs: list[GraphManager]) -> None:
    inbox: list[list[tuple[torch.Tensor, float]]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        mixing = SkewedMixing(graphs[i]) if case.skewed else UniformMixing(graphs[i])
        shares = mixing.shares(graphs[i].out_peers(round_index))
        for peer, share in shares.send.items():
            inbox[peer].append((node.x * share, _f32(node.w * share)))
        node.x = node.x * shares.keep
        node.w = _f32(node.w * shares.keep) if case.push_sum else 1.0
    for i, node in enumerate(nodes):
        # Messages were appended in sender order: the order the wrapper adds its in-peers' messages.
        node.pending.append(_sum_messages(inbox[i], case.push_sum))


def _sum_messages(messages: list[tuple[torch.Tensor, float]], push_sum: bool) -> tuple[torch.Tensor, float]:
    if not messages:
        return torch.tensor([]), 0.0
    x, w = messages[0]
    for mx, mw in messages[1:]:
        x, w = x + mx, _f32(w + mw)
    return x, (w if push_sum else 0.0)


def _apply_pending(node: _NodeState, push_sum: bool) -> None:
    for x, w in node.pending:
        if x.numel():
            node.x = node.x + x
            if push_sum:
                node.w = _f32(node.w + w)
    node.pending.clear()


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _average(nodes: list[_NodeState]) -> torch.Tensor:
    total = nodes[0].x
    for node in nodes[1:]:
        total = total + node.x
    return total / len(nodes)


def _per_rank(nodes: list[_NodeState], world_size: int, nprocs_per_node: int) -> list[tuple[torch.Tensor, float]]:
    return [(nodes[r // nprocs_per_node].x.clone(), nodes[r // nprocs_per_node].w) for r in range(world_size)]


def simulate(case: Case, world_size: int, nprocs_per_node: int, drain_at_end: bool = False) -> list[list[Any]]:
    """Per step, per rank: ``(flat parameters, push-sum weight)`` after ``perform_slowmo``."""
    num_nodes = world_size // nprocs_per_node
    model = make_model()
    start = flat_params(model)
    nodes = [_NodeState(start.clone()) for _ in range(num_nodes)]
    anchor, momentum = start.clone(), torch.zeros_like(start)
    slow_on = not (case.slowmo_lr == 1.0 and case.slowmo_momentum == 0.0)
    sgp = case.algorithm == "sgp"
    graphs = [GRAPHS[case.graph](n, num_nodes) for n in range(num_nodes)] if sgp and num_nodes > 1 else []
    round_index, history = 0, []
    for step in range(case.steps):
        count = step + 1
        outer = count % case.slowmo_frequency == 0
        for n, node in enumerate(nodes):
            _local_step(case, model, node, list(range(n * nprocs_per_node, (n + 1) * nprocs_per_node)), step)
        if sgp and case.overlap:
            for node in nodes:
                _apply_pending(node, case.push_sum)
        exact = num_nodes > 1 and (
            (not sgp and count % case.localsgd_frequency == 0 and not (slow_on and outer and case.memory_efficient))
            or (sgp and outer and not slow_on and case.average_params)
        )
        if exact:
            mean = _average(nodes)
            for node in nodes:
                node.x, node.w = mean.clone(), 1.0
        if slow_on and outer:
            mean = _average(nodes)
            momentum = case.slowmo_momentum * momentum + (anchor - mean) / case.lr
            anchor = anchor - case.slowmo_lr * case.lr * momentum
            for node in nodes:
                node.x, node.w = anchor.clone(), 1.0
        if sgp and num_nodes > 1 and not (outer and (slow_on or case.average_params)):
            _gossip_round(case, nodes, round_index, graphs)
            round_index += 1
            if not case.overlap:
                for node in nodes:
                    _apply_pending(node, case.push_sum)
        history.append(_per_rank(nodes, world_size, nprocs_per_node))
    if drain_at_end:
        for node in nodes:
            _apply_pending(node, case.push_sum)
        history.append(_per_rank(nodes, world_size, nprocs_per_node))
    return history
