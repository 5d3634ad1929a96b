"""Mixing weights: how much of its (numerator, weight) pair a node keeps and how much it pushes to each peer.

Every node splits what it holds into shares that sum to one (a column-stochastic mixing matrix), so the sum over
nodes is conserved: that is what lets push-sum recover the exact average. With a regular graph and uniform shares
the matrix is doubly stochastic too, which push-pull gossip relies on.

Example::

    mixing = UniformMixing(graph)
    shares = mixing.shares(graph.out_peers(0))     # MixingShares(keep=0.5, send={1: 0.5})
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Union

import torch

from shardkit.nn.slowmo.graphs import GraphManager


@dataclass(frozen=True)
class MixingShares:
    """One node's split of its values in one round: ``keep`` stays, ``send[peer]`` goes to ``peer``."""

    keep: float
    send: dict[int, float]


class MixingManager(ABC):
    """Chooses the mixing shares of node ``graph.rank`` round by round.

    ``device`` is accepted for fairscale compatibility; shares are plain floats.
    """

    def __init__(self, graph: GraphManager, device: Optional[torch.device] = None) -> None:
        if not isinstance(graph, GraphManager):
            raise TypeError(f"{type(self).__name__} needs a GraphManager, got {type(graph).__name__}")
        self.graph_manager = graph
        self.device = device

    @abstractmethod
    def is_uniform(self) -> bool:
        """Whether the kept share and every sent share are equal."""

    def is_regular(self) -> bool:
        """Whether mixing is doubly stochastic: uniform shares on a regular graph (no push-sum weight needed)."""
        return self.is_uniform() and self.graph_manager.is_regular_graph()

    @abstractmethod
    def shares(self, out_peers: list[int]) -> MixingShares:
        """The split for a round whose out-peers are ``out_peers``; the shares must sum to one."""

    def get_mixing_weights(self, residual_adjusted: bool = True) -> dict[Union[str, int], torch.Tensor]:
        """fairscale's form of the current round's shares (peers from ``graph_manager.get_peers()``).

        Keys: ``"lo"`` (the kept share), each out-peer's process rank (its share) and, for uniform mixing,
        ``"uniform"``. With ``residual_adjusted`` the sent shares are divided by the kept one (the factor to apply
        to values already scaled by ``"lo"``). One-element float32 tensors on ``device``. Subclasses define
        :meth:`shares`; this is derived from it.
        """
        out_peers, _ = self.graph_manager.get_peers()
        nprocs = self.graph_manager.nprocs_per_node
        shares = self.shares([peer // nprocs for peer in out_peers])

        scale = 1.0 / shares.keep if residual_adjusted else 1.0

        def weight(share: float) -> torch.Tensor:
            return torch.tensor([share], device=self.device)

        weights: dict[Union[str, int], torch.Tensor] = {"lo": weight(shares.keep)}
        if self.is_uniform():
            weights["uniform"] = weight(shares.keep * scale)
        for peer in out_peers:
            weights[peer] = weight(shares.send[peer // nprocs] * scale)
        return weights


class UniformMixing(MixingManager):
    """Keep ``1/(k+1)`` and send ``1/(k+1)`` to each of the ``k`` out-peers."""

    def is_uniform(self) -> bool:
        return True

    def shares(self, out_peers: list[int]) -> MixingShares:
        share = 1.0 / (len(out_peers) + 1)
        return MixingShares(keep=share, send={peer: share for peer in out_peers})


__all__ = ["MixingManager", "MixingShares", "UniformMixing"]
