"""How many of a collective's bytes cross between nodes: the model the comm meter and the inter-node link use.

The meter's ``wire_bytes`` is what one rank of the group sends, averaged over the group's ranks. The share of it
that leaves the node depends on the algorithm; shardkit models four patterns, with the group's ranks in group-rank
order (torchrun's contiguous ranks put each node's members next to each other):

* ``ring`` (all-reduce, all-gather, reduce-scatter, and the backends' broadcast and reduce): the ranks form a ring
  in group-rank order and every step each rank sends one chunk to the next. Of the ring's ``g`` links, ``c`` join
  two different nodes (``c = k`` for ``k`` nodes holding contiguous blocks, ``c = 0`` inside one node), so the
  inter-node share is ``c / g``. For an all-reduce over 4 ranks on 2 nodes: half of its ``2(g-1)/g`` bytes.
* ``exchange`` (the ``by_sends`` all-gather and reduce-scatter): every rank sends one chunk to every peer, so the
  share is the fraction of (sender, receiver) pairs on different nodes.
* ``rooted`` (the ``by_sends`` broadcast and reduce): the root sends to, or receives from, every other member; the
  share is the fraction of those members on another node.
* ``p2p`` (send): all of it when the peer is on another node, else none.

Which rank runs on which node comes from :func:`set_topology` (a :class:`~shardkit.distributed.Topology` or
:class:`~shardkit.distributed.NodeLayout`, once per process), else from torchrun's ``LOCAL_WORLD_SIZE``
(contiguous ranks per node), else everything is one node.

Example::

    set_topology(Topology.from_env())
    with count_comm_bytes() as meter:
        train_step()
    meter.total_inter_node_bytes, meter.inter_node_bytes["all_reduce"]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional, Union

import torch.distributed as dist

from shardkit.distributed.instrumentation import INSTRUMENTATION
from shardkit.distributed.topology import NodeLayout, Topology

#: The algorithms whose inter-node share the model knows (see the module docstring).
PATTERNS = ("ring", "exchange", "rooted", "p2p")


def set_topology(topology: Union[Topology, NodeLayout, None]) -> None:
    """Tell the comm meter and :func:`~shardkit.distributed.comm_delay` which ranks share a node (None: forget).

    Call once per process, on every rank, with the job's layout (global ranks). Without it the layout comes from
    ``LOCAL_WORLD_SIZE`` as torchrun sets it.
    """
    layout = topology.layout if isinstance(topology, Topology) else topology
    if layout is not None and not isinstance(layout, NodeLayout):
        raise TypeError(f"set_topology takes a Topology, a NodeLayout or None, got {type(topology).__name__}")
    if layout is not None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
        if sorted(layout.node_of_rank()) != list(range(world_size)):
            raise ValueError(
                f"set_topology: the layout {layout.nodes} must place every global rank 0..{world_size - 1} of this "
                "job on a node (pass the job's Topology, or NodeLayout.contiguous(world_size, nprocs_per_node))"
            )
    INSTRUMENTATION.node_layout = layout  # replaced whole: readers on any thread see the old or the new one


def active_layout() -> Optional[NodeLayout]:
    """The layout :func:`set_topology` gave, or None (then :func:`node_of` reads the environment)."""
    return INSTRUMENTATION.node_layout


def node_of(rank: int) -> int:
    """The node of global ``rank`` under the active layout, else ``rank // LOCAL_WORLD_SIZE``, else 0."""
    layout = INSTRUMENTATION.node_layout
    if layout is not None:
        return layout.node_of(rank)
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(text) if text.strip().isdigit() and int(text) > 0 else 0
    return rank // per_node if per_node else 0


def inter_node_share(ranks: Sequence[int], pattern: str, me: int = 0, peer: Optional[int] = None) -> float:
    """The fraction of a collective's wire bytes that cross nodes (see the module docstring for the model).

    ``ranks`` are the group's global ranks in group-rank order; ``me`` is the index of the root (``rooted``);
    ``peer`` the other end's global rank (``p2p``).
    """
    if pattern == "p2p":
        return 0.0 if peer is None else float(node_of(peer) != node_of(ranks[me]))
    nodes = [node_of(rank) for rank in ranks]
    g = len(nodes)
    if g < 2 or len(set(nodes)) == 1:
        return 0.0
    if pattern == "ring":
        return sum(nodes[i] != nodes[(i + 1) % g] for i in range(g)) / g
    if pattern == "exchange":
        crossing = sum(a != b for a in nodes for b in nodes)
        return crossing / (g * (g - 1))
    if pattern == "rooted":
        return sum(node != nodes[me] for node in nodes) / (g - 1)
    raise ValueError(f"unknown traffic pattern {pattern!r}; expected one of {PATTERNS}")


__all__ = ["PATTERNS", "active_layout", "inter_node_share", "node_of", "set_topology"]
