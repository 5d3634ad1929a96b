"""Gossip graphs: who sends to whom in each round of Stochastic Gradient Push.

Ranks here are *node* ranks (``rank // nprocs_per_node``); only one process per node gossips. A graph is a
"phone book": for every node, an ordered list of out-peers. In round ``r`` a node sends to ``peers_per_itr`` of
them; dynamic graphs move on by ``peers_per_itr`` entries every round, static graphs always use the first ones.
Peers are a pure function of the round number, so every node agrees on the round's edges without talking.

Subclasses describe the phone book by calling :meth:`GraphManager._add_peers` from :meth:`_make_graph`, as in
fairscale; the constructor then checks the book is usable (every node has the same number of peers, no
self-loops) and says what to change if not.

Example::

    graph = DynamicDirectedExponentialGraph(rank=0, world_size=4)
    graph.out_peers(0), graph.in_peers(0)      # ([1], [3]) in round 0; ([3], [1]) in round 1
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional


def _int_log(value: int, base: int) -> int:
    """``floor(log_base(value))`` for ``value >= 1``, in integers (float logs misround exact powers)."""
    exponent = 0
    while base ** (exponent + 1) <= value:
        exponent += 1
    return exponent


@dataclass(frozen=True)
class Edge:
    """One directed gossip edge between two processes (node masters): ``src`` sends to ``dest``.

    fairscale built a two-rank process group per edge; shardkit gossips with point-to-point messages over one group
    of node masters, so an edge holds no group and :attr:`process_group` says so.
    """

    src: int
    dest: int

    @property
    def process_group(self) -> Any:
        """Not available: there are no per-edge process groups in shardkit."""
        raise AttributeError(
            "shardkit's gossip edges have no process_group: gossip runs as point-to-point sends over the node "
            "masters' group. Use edge.src / edge.dest (process ranks) with torch.distributed.isend/irecv, or "
            "PushSum/PushPull.mix, which do the exchange."
        )


class GraphManager(ABC):
    """A gossip topology over ``world_size`` nodes, seen from node ``rank``.

    ``nprocs_per_node`` and ``local_rank`` are accepted for fairscale compatibility (the wrapper maps nodes to
    processes itself). Use :meth:`out_peers` / :meth:`in_peers` to get a round's edges. fairscale's stateful
    :meth:`get_peers` / :meth:`get_edges` (rotated by the gossipers after every round) are offered too.
    """

    def __init__(
        self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0, peers_per_itr: int = 1
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"{type(self).__name__} needs 0 <= rank < world_size and world_size >= 2 nodes, got rank={rank}, "
                f"world_size={world_size} (with one node there is nobody to gossip with)"
            )
        if peers_per_itr < 1:
            raise ValueError(f"peers_per_itr must be >= 1, got {peers_per_itr}")
        self.rank = rank
        self.world_size = world_size
        self.nprocs_per_node = nprocs_per_node
        self.local_rank = local_rank
        self.peers_per_itr = peers_per_itr
        self.phone_book: list[list[int]] = [[] for _ in range(world_size)]
        self._rotations = 0  # how often get_peers/get_edges rotated (fairscale's group indices)
        self._make_graph()
        self._check_phone_book()

    @abstractmethod
    def _make_graph(self) -> None:
        """Fill the phone book with :meth:`_add_peers` for every node."""

    def is_regular_graph(self) -> bool:
        """True when in every round each node receives from exactly as many peers as it sends to."""
        period = len(self.phone_book[0]) if self.is_dynamic_graph() else 1
        for round_index in range(period):
            in_degree = [0] * self.world_size
            for node in range(self.world_size):
                for peer in self._out_peers_of(node, round_index):
                    in_degree[peer] += 1
            if any(d != min(self.peers_per_itr, len(self.phone_book[0])) for d in in_degree):
                return False
        return True

    @abstractmethod
    def is_bipartite_graph(self) -> bool:
        """Whether nodes split into passive and active halves that only talk across."""

    @abstractmethod
    def is_passive(self, rank: Optional[int] = None) -> bool:
        """Whether node ``rank`` (default: this node) is on the passive side of a bipartite graph."""

    @abstractmethod
    def is_dynamic_graph(self) -> bool:
        """Whether the out-peers change from round to round."""

    def out_peers(self, round_index: int) -> list[int]:
        """Nodes this node sends to in round ``round_index``."""
        return self._out_peers_of(self.rank, round_index)

    def in_peers(self, round_index: int) -> list[int]:
        """Nodes that send to this node in round ``round_index``, in increasing order."""
        return [n for n in range(self.world_size) if n != self.rank and self.rank in self._out_peers_of(n, round_index)]

    def get_peers(self, rotate: bool = False) -> tuple[list[int], list[int]]:
        """fairscale's stateful view: ``(out_peers, in_peers)`` now, after first moving on one step if ``rotate``.

        As in fairscale, out-peers are the *process* ranks of the peer nodes' masters (``node * nprocs_per_node``)
        and in-peers are *node* ranks; the two agree when ``nprocs_per_node == 1``. Rotation moves every node's
        choice by ``peers_per_itr`` entries of its phone book, for static graphs too (gossipers only rotate dynamic
        graphs). :meth:`out_peers` / :meth:`in_peers` give any round's peers without state.
        """
        if rotate:
            self._rotations += 1
        out_nodes, in_nodes = self._current_peers()
        return [n * self.nprocs_per_node for n in out_nodes], in_nodes

    def get_edges(self, rotate: bool = False) -> tuple[list[Edge], list[Edge]]:
        """Like :meth:`get_peers`, as :class:`Edge`\\ s between process ranks: ``(out_edges, in_edges)``."""
        if rotate:
            self._rotations += 1
        out_nodes, in_nodes = self._current_peers()
        me = self.rank * self.nprocs_per_node
        return (
            [Edge(me, n * self.nprocs_per_node) for n in out_nodes],
            [Edge(n * self.nprocs_per_node, me) for n in in_nodes],
        )

    def _current_peers(self) -> tuple[list[int], list[int]]:
        """Out- and in-peer nodes at the current rotation (ignoring whether the graph is dynamic)."""
        out_nodes = self._peers_at(self.rank, self._rotations)
        others = [(n, self._peers_at(n, self._rotations)) for n in range(self.world_size) if n != self.rank]
        # fairscale's order: by peer slot first, then by node.
        in_nodes = [n for slot in range(len(out_nodes)) for n, peers in others if peers[slot] == self.rank]
        return out_nodes, in_nodes

    def _out_peers_of(self, node: int, round_index: int) -> list[int]:
        return self._peers_at(node, round_index if self.is_dynamic_graph() else 0)

    def _peers_at(self, node: int, step: int) -> list[int]:
        book = self.phone_book[node]
        count = min(self.peers_per_itr, len(book))
        return [book[(step * count + j) % len(book)] for j in range(count)]

    def _add_peers(self, rank: int, peers: list[int]) -> None:
        for peer in peers:
            if peer not in self.phone_book[rank]:
                self.phone_book[rank].append(peer)

    def _rotate_forward(self, r: int, p: int) -> int:
        return (r + p) % self.world_size

    def _rotate_backward(self, r: int, p: int) -> int:
        return (r - p) % self.world_size

    def _check_phone_book(self) -> None:
        name = type(self).__name__
        lengths = {len(book) for book in self.phone_book}
        if 0 in lengths or len(lengths) != 1:
            hint = " (bipartite graphs need an even number of nodes)" if self.is_bipartite_graph() else ""
            raise ValueError(
                f"{name} cannot be built over {self.world_size} nodes{hint}: nodes have {sorted(lengths)} out-peers "
                "but every node needs the same non-zero number. Choose another graph or number of nodes."
            )
        for node, book in enumerate(self.phone_book):
            if node in book or not all(0 <= p < self.world_size for p in book):
                raise ValueError(f"{name}: node {node} has an invalid peer list {book} over {self.world_size} nodes")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, peers={self.peers_per_itr})"


class _NotBipartite:
    def is_bipartite_graph(self) -> bool:
        return False

    def is_passive(self, rank: Optional[int] = None) -> bool:
        return False


class _Bipartite:
    rank: int

    def is_bipartite_graph(self) -> bool:
        return True

    def is_passive(self, rank: Optional[int] = None) -> bool:
        """Even nodes are passive, odd nodes active."""
        return (self.rank if rank is None else rank) % 2 == 0


class RingGraph(_NotBipartite, GraphManager):
    """A static ring: with one peer per round every node always sends to the next node."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            self._add_peers(rank, [self._rotate_forward(rank, 1), self._rotate_backward(rank, 1)])

    def is_dynamic_graph(self) -> bool:
        return False


class DynamicDirectedExponentialGraph(_NotBipartite, GraphManager):
    """Peers at distances ±1, ±2, ±4, ... cycled round by round: information spreads in ``log2(n)`` rounds."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(_int_log(self.world_size - 1, 2) + 1):
                self._add_peers(rank, [self._rotate_forward(rank, 2**i), self._rotate_backward(rank, 2**i)])

    def is_dynamic_graph(self) -> bool:
        return True


class NPeerDynamicDirectedExponentialGraph(_NotBipartite, GraphManager):
    """Forward peers at distances ``j*(p+1)^i`` for ``j = 1..p``: the default graph (``p = peers_per_itr``)."""

    def _make_graph(self) -> None:
        base = self.peers_per_itr + 1
        for rank in range(self.world_size):
            for i in range(_int_log(self.world_size - 1, base) + 1):
                for j in range(1, self.peers_per_itr + 1):
                    self._add_peers(rank, [self._rotate_forward(rank, j * base**i)])

    def is_dynamic_graph(self) -> bool:
        return True


class DynamicBipartiteExponentialGraph(_Bipartite, GraphManager):
    """Exponential distances ``1, 1+2, 1+4, ...`` between passive (even) and active (odd) nodes."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(_int_log(self.world_size - 1, 2) + 1):
                distance = 1 if i == 0 else 1 + 2**i
                self._add_across(rank, self._rotate_forward(rank, distance), self._rotate_backward(rank, distance))

    def _add_across(self, rank: int, forward: int, backward: int) -> None:
        if self.is_passive(rank) != self.is_passive(forward) and self.is_passive(rank) != self.is_passive(backward):
            self._add_peers(rank, [forward, backward])

    def is_dynamic_graph(self) -> bool:
        return True


class DynamicDirectedLinearGraph(_NotBipartite, GraphManager):
    """Peers at every odd distance ±1, ±3, ±5, ..., cycled round by round."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for distance in range(1, self.world_size, 2):
                self._add_peers(rank, [self._rotate_forward(rank, distance), self._rotate_backward(rank, distance)])

    def is_dynamic_graph(self) -> bool:
        return True


class DynamicBipartiteLinearGraph(DynamicBipartiteExponentialGraph):
    """Every distance between passive (even) and active (odd) nodes, cycled round by round."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for distance in range(1, self.world_size):
                self._add_across(rank, self._rotate_forward(rank, distance), self._rotate_backward(rank, distance))


__all__ = [
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "Edge",
    "GraphManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
]
