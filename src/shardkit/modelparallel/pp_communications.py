"""Point-to-point traffic between the stages of one model replica: activations forward, gradients back.

Sends are asynchronous and never block the sender; receives block only when their data is needed. Every
message between two stages is posted in the same order on both sides (the plan's call order within a
micro-batch, micro-batches in schedule order), which is what NCCL needs and what keeps gloo's tag-free
matching exact. A payload is copied before it is sent, so glue code that later updates the same tensor in
place (``x += residual``) cannot race the transfer. Time spent blocked on receives is counted: it is the
pipeline bubble as this stage saw it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed import GroupLike, broadcast_object
from shardkit.distributed import collectives as C
from shardkit.modelparallel.topology import Topology


class StageLink:
    """Sends and receives tensors between this rank's stage and the other stages of its replica."""

    def __init__(self, group: GroupLike, topology: Topology, mp_group: GroupLike) -> None:
        self.group = group
        self.topology = topology
        self.mp_group = mp_group
        self._pending: list[tuple[C.Handle, torch.Tensor]] = []
        self.wait_s = 0.0
        """Seconds blocked on receives since the last :meth:`reset_stats`."""
        self.sent_bytes = 0

    def send(self, tensor: torch.Tensor, dst_stage: int, label: str, private: bool = False) -> None:
        """Queue ``tensor`` for stage ``dst_stage``; returns at once.

        The tensor is copied first unless ``private`` says nobody else will write it (nor free it early).
        """
        payload = tensor.detach()
        if not private or not payload.is_contiguous():
            payload = payload.clone(memory_format=torch.contiguous_format)
        handle = C.send(payload, self.topology.stage_rank(dst_stage), group=self.group, label=label)
        self._pending.append((handle, payload))
        self.sent_bytes += payload.numel() * payload.element_size()
        if len(self._pending) > 64:
            self._reap()

    def recv_many(
        self, specs: Sequence[tuple[tuple[int, ...], torch.dtype, int]], device: torch.device, label: str
    ) -> list[torch.Tensor]:
        """Receive one tensor per ``(shape, dtype, src_stage)``, posting every receive before waiting on any."""
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in specs]
        handles = [
            C.recv(buf, self.topology.stage_rank(src), group=self.group, label=label)
            for buf, (_, _, src) in zip(buffers, specs)
        ]
        start = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.wait_s += time.perf_counter() - start
        return buffers

    def share_from(self, obj: Any, src_stage: int) -> Any:
        """Broadcast a small picklable object from stage ``src_stage`` to the whole replica."""
        return broadcast_object(obj, src_in_group=src_stage, group=self.mp_group)

    def _reap(self) -> None:
        still = []
        for handle, payload in self._pending:
            if handle.is_completed():
                handle.wait()
            else:
                still.append((handle, payload))
        self._pending = still

    def wait_sends(self) -> None:
        """Block until every queued send has left (their buffers are then freed)."""
        for handle, _ in self._pending:
            handle.wait()
        self._pending = []

    def reset_stats(self) -> None:
        """Zero the counters."""
        self.wait_s = 0.0
        self.sent_bytes = 0


def broadcast_tensors(tensors: list[torch.Tensor], src_stage: int, group: GroupLike, label: str) -> list[torch.Tensor]:
    """Replace ``tensors`` by stage ``src_stage``'s values (same shapes everywhere), one message per dtype."""
    if not tensors or isinstance(group, C.DummyProcessGroup) or dist.get_world_size(group) == 1:
        return tensors
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(i)
    for (dtype, device), indices in by_dtype.items():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices]).to(dtype=dtype, device=device)
        C.broadcast(flat, src_stage, group=group, label=label)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view(tensors[i].shape)
            offset += n
    return [t for t in out if t is not None]
