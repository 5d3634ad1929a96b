"""Gossip rounds of Stochastic Gradient Push between node masters.

One round, for node ``i`` with out-peers ``O`` and mixing shares ``keep``, ``send[j]``::

    message_j = send[j] * (x_i, w_i)            for j in O       (sent)
    (x_i, w_i) <- keep * (x_i, w_i)                               (kept)
    (x_i, w_i) += sum messages received from in-peers               (when the round completes)

With push-pull the weight is left out (it stays 1). Without overlap a round completes inside the same call; with
overlap it is started and completes at a later step (see :class:`~shardkit.nn.slowmo.config.GossipConfig`), while
training goes on with the kept part. Every node runs the same rounds in the same order, so round ``r``'s peers,
known to all from the graph, always match.

"In the background" needs no Python thread: the exchange is asynchronous point-to-point work that gloo's and
NCCL's own transport threads and streams carry while training continues, and the main thread only waits on its
handles. Gossip gets a process group of its own (the node masters), so its messages in flight never interleave
with the collectives the masters issue meanwhile (exact averages, broadcasts), which gloo requires to be issued in
the same order on every rank.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit.distributed import GroupLike
from shardkit.distributed.collectives import Handle
from shardkit.nn.slowmo.collectives import exchange
from shardkit.nn.slowmo.flat import FlatParams
from shardkit.nn.slowmo.graphs import GraphManager
from shardkit.nn.slowmo.mixing import MixingManager
from shardkit.nn.slowmo.push_sum import ParamForm, PushSumState


@dataclass
class _Round:
    """A round in flight: its handles and the buffers they read and write (kept alive until completion)."""

    index: int
    handles: list[Handle]
    outgoing: dict[int, torch.Tensor]
    incoming: dict[int, torch.Tensor]

    def done(self) -> bool:
        return all(h.is_completed() for h in self.handles)


class Gossiper:
    """Runs gossip rounds for this node's master (other ranks never call it).

    ``comm_device`` holds the message buffers; ``use_streams`` prepares messages on a side CUDA stream (only when
    the parameters are on CUDA).
    """

    def __init__(
        self,
        graph: GraphManager,
        mixing: MixingManager,
        push_sum: bool,
        group: Optional[GroupLike],
        comm_device: torch.device,
        use_streams: bool,
    ) -> None:
        self.graph = graph
        self.mixing = mixing
        self.push_sum = push_sum
        if group is None:
            raise ValueError("Gossiper runs on node masters, which are members of the gossip group")
        self.group: GroupLike = group
        self.comm_device = comm_device
        self.use_streams = use_streams
        self.round_index = 0
        self.in_flight: deque[_Round] = deque()
        self._stream: Optional[torch.cuda.Stream] = None

    @contextlib.contextmanager
    def _side_stream(self, device: torch.device) -> Iterator[None]:
        if not (self.use_streams and device.type == "cuda"):
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        # The parameters are scaled in place next, on the current stream: the messages must be taken first.
        current.wait_stream(self._stream)

    def start_round(self, flat: FlatParams, state: PushSumState) -> None:
        """Take this round's messages from the parameters, keep this node's share, and post the exchange."""
        state.require(ParamForm.NUMERATOR, "gossip")
        out_peers = self.graph.out_peers(self.round_index)
        in_peers = self.graph.in_peers(self.round_index)
        shares = self.mixing.shares(out_peers)
        extra = 1 if self.push_sum else 0
        # Buffers are allocated on the current stream: it outlives the round's use of them, so the caching
        # allocator never hands them out while a side-stream copy or the exchange still reads them.
        base = flat.new_buffer(flat.tensors[0].dtype, self.comm_device, extra)
        uniform = len(set(shares.send.values())) <= 1
        outgoing = dict.fromkeys(shares.send, base) if uniform else {p: torch.empty_like(base) for p in shares.send}
        incoming = {peer: torch.empty_like(base) for peer in in_peers}
        with self._side_stream(flat.device):
            flat.copy_to(base)
            if self.push_sum:
                base[-1] = state.weight
            if uniform and shares.send:
                base.mul_(next(iter(shares.send.values())))  # one scaled buffer serves every peer
            elif not uniform:
                for peer, share in shares.send.items():
                    torch.mul(base, share, out=outgoing[peer])
            handles = exchange(outgoing, incoming, self.group)
        with torch.no_grad():
            for p in flat.tensors:
                p.mul_(shares.keep)
        if self.push_sum:
            state.set_weight(float(torch.tensor(state.weight * shares.keep, dtype=torch.float32)))
        self.in_flight.append(_Round(self.round_index, handles, outgoing, incoming))
        self.round_index += 1

    def complete(self, flat: FlatParams, state: PushSumState, wait: bool) -> int:
        """Add the messages of finished rounds, oldest first; with ``wait`` finish all of them. Returns how many."""
        finished = 0
        while self.in_flight and (wait or self.in_flight[0].done()):
            gossip_round = self.in_flight.popleft()
            for handle in gossip_round.handles:
                handle.wait()
            self._add_received(gossip_round, flat, state)
            finished += 1
        return finished

    def _add_received(self, gossip_round: _Round, flat: FlatParams, state: PushSumState) -> None:
        received = list(gossip_round.incoming.values())
        if not received:
            return
        total = received[0]
        for other in received[1:]:
            total = total + other
        extra = 1 if self.push_sum else 0
        mixed = flat.copy_to(flat.new_buffer(total.dtype, self.comm_device, extra))
        if self.push_sum:
            mixed[-1] = state.weight
        mixed += total
        flat.copy_from(mixed)
        if self.push_sum:
            state.set_weight(float(mixed[-1]))

    def close(self) -> None:
        """Wait for rounds in flight without applying them (used when the wrapper is torn down)."""
        while self.in_flight:
            for handle in self.in_flight.popleft().handles:
                handle.wait()
