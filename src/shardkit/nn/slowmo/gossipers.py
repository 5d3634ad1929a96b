"""fairscale's stand-alone gossipers, ``PushSum`` and ``PushPull``: one gossip exchange per :meth:`mix` call.

:class:`~shardkit.nn.slowmo.api.SlowMoDistributedDataParallel` does not use them (its rounds live in
:mod:`.gossip`); they are for code that drove fairscale's gossipers by hand. The protocol is fairscale's: the
caller has already scaled its values by its kept share (``mixing_weights["lo"]``); ``mix(out_msg, ps_weight)``
sends ``out_msg`` (times each peer's residual-adjusted weight, 1 for uniform mixing) to this round's out-peers,
receives from its in-peers, and returns the sum of what arrived and the sum of the arriving push-sum weights; the
caller adds them to what it kept. The peers then move on if the graph is dynamic.

The exchange is point-to-point over the default (world) group, peers being the node masters' process ranks
(``node * nprocs_per_node``) as in fairscale; it needs no per-edge process groups. Receives are posted before
sends, so the order in which active and passive nodes talk (fairscale's ``passive`` flag) does not matter.

Example::

    graph = RingGraph(rank, world_size)
    gossiper = PushSum(torch.zeros(n), graph)
    x.mul_(gossiper.mixing_weights["lo"]); w = w * gossiper.mixing_weights["lo"]
    received, received_w = gossiper.mix(x, w)
    x += received; w = w + received_w
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from shardkit.distributed import GroupLike, group_rank, group_size, resolve_group
from shardkit.nn.slowmo.collectives import exchange
from shardkit.nn.slowmo.graphs import Edge, GraphManager
from shardkit.nn.slowmo.mixing import MixingManager, UniformMixing


class Gossiper:
    """The common part of :class:`PushSum` and :class:`PushPull` (fairscale's arguments and attributes).

    Args:
        msg: a tensor shaped like the messages (only its shape and dtype are used).
        graph: the gossip graph, built for this process's node (``rank // nprocs_per_node``).
        device: where messages are exchanged (default: ``msg``'s device; use the CPU with gloo).
        mixing: the mixing weights (default: :class:`UniformMixing`).
        logger: receives a debug line per exchange.
        rank: this process's rank in the default group (checked; default: asked from ``torch.distributed``).
        world_size: the default group's size (checked likewise).
    """

    def __init__(
        self,
        msg: torch.Tensor,
        graph: GraphManager,
        device: Optional[torch.device] = None,
        mixing: Optional[MixingManager] = None,
        logger: Optional[logging.Logger] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(graph, GraphManager):
            raise TypeError(f"{name} needs a shardkit.nn.slowmo GraphManager, got {type(graph).__name__}")
        mixing = UniformMixing(graph, device) if mixing is None else mixing
        if not isinstance(mixing, MixingManager) or mixing.graph_manager is not graph:
            raise ValueError(f"{name}: mixing must be a MixingManager built over the same graph object")
        self.group: GroupLike = resolve_group(None, name)
        actual_rank, actual_size = group_rank(self.group), group_size(self.group)
        for arg, given, actual in (("rank", rank, actual_rank), ("world_size", world_size, actual_size)):
            if given is not None and given != actual:
                raise ValueError(f"{name}: {arg}={given}, but the default process group says {actual}")
        if graph.rank * graph.nprocs_per_node != actual_rank:
            raise ValueError(
                f"{name}: {graph!r} was built for node {graph.rank}, whose master is process "
                f"{graph.rank * graph.nprocs_per_node}, but this is process {actual_rank}; only node masters gossip. "
                "Build the graph with rank=process_rank // nprocs_per_node on each node's first process."
            )
        self.rank, self.world_size = actual_rank, actual_size
        self.logger = logger
        self.device = torch.device(device) if device is not None else msg.device
        self.dtype = msg.dtype
        self.numel = msg.numel()
        self._graph_manager = graph
        self._mixing_manager = mixing
        self.passive = graph.is_passive()
        self.regular = mixing.is_regular()
        self.out_edges: list[Edge] = []
        self.in_edges: list[Edge] = []
        self.refresh_peers_(rotate=False)
        self.mixing_weights = mixing.get_mixing_weights(residual_adjusted=False)

    @property
    def peers_per_itr(self) -> int:
        """How many peers each round talks to (the graph's)."""
        return self._graph_manager.peers_per_itr

    def refresh_peers_(self, rotate: Optional[bool] = None) -> None:
        """Take this round's edges from the graph, moving it on first if ``rotate`` (default: if dynamic)."""
        if rotate is None:
            rotate = self._graph_manager.is_dynamic_graph()
        self.out_edges, self.in_edges = self._graph_manager.get_edges(rotate)

    def refresh_mixing_weights_(self, residual_adjusted: bool = False) -> None:
        """Recompute :attr:`mixing_weights` for the current peers."""
        self.mixing_weights = self._mixing_manager.get_mixing_weights(residual_adjusted)

    def mix(self, out_msg: torch.Tensor, ps_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One exchange: returns ``(sum of received messages, sum of received push-sum weights)``.

        ``out_msg`` (flat, ``msg``'s shape and dtype) and ``ps_weight`` (one element) are this process's already
        scaled share; they are not modified. Every node master of the graph must call it the same number of times.
        """
        if out_msg.numel() != self.numel or out_msg.dtype != self.dtype:
            raise ValueError(
                f"{type(self).__name__}.mix: out_msg has {out_msg.numel()} {out_msg.dtype} elements, but the "
                f"gossiper was built for {self.numel} {self.dtype} elements"
            )
        self.refresh_mixing_weights_(residual_adjusted=True)
        weight = ps_weight.reshape(1).to(self.device, self.dtype)
        payload = out_msg.detach().reshape(-1).to(self.device)
        if not self.regular:  # the push-sum weight travels with the message
            payload = torch.cat([payload, weight])
        outgoing = {edge.dest: payload * self.mixing_weights[edge.dest].to(payload) for edge in self.out_edges}
        incoming = {edge.src: torch.empty_like(payload) for edge in self.in_edges}
        if self.logger is not None:
            self.logger.debug("gossip: out-peers %s, in-peers %s", list(outgoing), list(incoming))
        for handle in exchange(outgoing, incoming, self.group):
            handle.wait()
        received = torch.zeros_like(payload)
        for buffer in incoming.values():
            received += buffer
        self.refresh_peers_()
        if not self.regular:
            return received[:-1], received[-1:]
        # Regular mixing: every in-peer held the same weight, so the received weight is known without sending it.
        return received, weight * len(incoming)


class PushSum(Gossiper):
    """Push-sum gossip: each message carries its push-sum weight unless mixing is regular (doubly stochastic)."""


class PushPull(Gossiper):
    """Push-pull gossip: needs regular (doubly stochastic) mixing, so no push-sum weight is exchanged."""

    def __init__(
        self,
        msg: torch.Tensor,
        graph: GraphManager,
        device: Optional[torch.device] = None,
        mixing: Optional[MixingManager] = None,
        logger: Optional[logging.Logger] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        super().__init__(msg, graph, device, mixing, logger, rank, world_size)
        if not self.regular:
            raise ValueError(
                f"PushPull needs doubly stochastic mixing (uniform mixing on a regular graph); {graph!r} with "
                f"{type(self._mixing_manager).__name__} is not. Use PushSum, which corrects the bias with a weight."
            )


__all__ = ["Gossiper", "PushPull", "PushSum"]
