"""Point-to-point traffic between the stages of one model replica: activations forward, gradients back.

Every message between two stages is posted in the same order on both sides (the plan's call order within a
micro-batch, micro-batches in schedule order), which keeps tag-free matching exact. A payload is copied before it
is sent, so glue code that later updates the same tensor in place (``x += residual``) cannot race the transfer.
Time spent blocked on receives is counted: it is the pipeline bubble as this stage saw it.

Whether a send may block decides how messages are posted. gloo's sends never block the sender, so each goes out
at once and a receive is posted when it is needed. NCCL's do: a send runs on the communicator's stream and waits
there until the peer's matching receive runs. In 1F1B with two stages, stage 0 posts "send activation k+1, then
receive gradient k" while stage 1 posts "send gradient k, then receive activation k+1": each send waits behind the
other stage's send, forever. So on such a transport (:attr:`P2PTransport.batches`) sends are held back and posted
together with this stage's next receives (or at :meth:`StageLink.wait_sends`) as one group
(``batch_isend_irecv``), whose operations progress together: no send can wait on a receive queued behind it.
CUDA tensors on a gloo group (which cannot send them) travel through host memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed import GroupLike, broadcast_object
from shardkit.distributed import collectives as C
from shardkit.modelparallel.topology import Topology


@dataclass(frozen=True)
class Message:
    """One tensor to send to, or receive from, global rank ``peer``."""

    tensor: torch.Tensor
    peer: int
    label: str


class P2PTransport(Protocol):
    """How a :class:`StageLink` posts its messages."""

    #: True when a send may block until its receive runs (NCCL): sends are then posted in one group with the
    #: next receives. False (gloo): every message is posted on its own, sends at once.
    batches: bool

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[C.Handle]:
        """Post ``sends`` and ``recvs`` (as one group when :attr:`batches`); one or more handles covering all."""
        ...


class TorchP2P:
    """:class:`P2PTransport` over a torch process group: labelled sends and receives, grouped under NCCL."""

    def __init__(self, group: GroupLike) -> None:
        self.group = group
        self.batches = isinstance(group, dist.ProcessGroup) and dist.get_backend(group) == "nccl"
        self._host_staged = isinstance(group, dist.ProcessGroup) and dist.get_backend(group) == "gloo"

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[C.Handle]:
        """See :meth:`P2PTransport.post`."""
        if self.batches:
            return self._post_group(sends, recvs)
        handles = [self._recv(m) for m in recvs]
        return handles + [self._send(m) for m in sends]

    def _post_group(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[C.Handle]:
        if not sends and not recvs:
            return []
        assert isinstance(self.group, dist.ProcessGroup)
        ops = [dist.P2POp(dist.irecv, m.tensor, m.peer, self.group) for m in recvs]
        ops += [dist.P2POp(dist.isend, m.tensor, m.peer, self.group) for m in sends]
        labels = ",".join(sorted({m.label for m in (*sends, *recvs)}))
        with record_function(f"shardkit::batch_send_recv:{labels}"):
            what = f"pipeline send/recv ({labels}) with ranks {sorted({m.peer for m in (*sends, *recvs)})}"
            return [C.Handle(work, what=what) for work in dist.batch_isend_irecv(ops)]

    def _send(self, message: Message) -> C.Handle:
        tensor = message.tensor
        if self._host_staged and tensor.is_cuda:  # gloo has no CUDA send: the bytes leave from a host copy
            tensor = tensor.to("cpu")
        handle = C.send(tensor, message.peer, group=self.group, label=message.label)
        return _KeepAlive(handle, tensor) if tensor is not message.tensor else handle

    def _recv(self, message: Message) -> C.Handle:
        if not (self._host_staged and message.tensor.is_cuda):
            return C.recv(message.tensor, message.peer, group=self.group, label=message.label)
        host = torch.empty(message.tensor.shape, dtype=message.tensor.dtype)
        handle = C.recv(host, message.peer, group=self.group, label=message.label)
        return _ThenCopy(handle, host, message.tensor)


class _KeepAlive(C.Handle):
    """A handle that holds the tensor its operation reads until it is waited on."""

    def __init__(self, inner: C.Handle, tensor: torch.Tensor) -> None:
        super().__init__()
        self._inner = inner
        self._tensor: Optional[torch.Tensor] = tensor

    def wait(self) -> None:
        self._inner.wait()
        self._tensor = None

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class _ThenCopy(C.Handle):
    """A receive into host memory whose :meth:`wait` also copies the data to its device tensor."""

    def __init__(self, inner: C.Handle, host: torch.Tensor, target: torch.Tensor) -> None:
        super().__init__()
        self._inner, self._target = inner, target
        self._host: Optional[torch.Tensor] = host

    def wait(self) -> None:
        self._inner.wait()
        if self._host is not None:
            self._target.copy_(self._host)
            self._host = None

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class StageLink:
    """Sends and receives tensors between this rank's stage and the other stages of its replica."""

    def __init__(
        self, group: GroupLike, topology: Topology, mp_group: GroupLike, transport: Optional[P2PTransport] = None
    ) -> None:
        self.group = group
        self.topology = topology
        self.mp_group = mp_group
        self.transport: P2PTransport = transport if transport is not None else TorchP2P(group)
        self._outbox: list[Message] = []
        # Posted work and the tensors it reads or writes, kept alive until the work is waited on.
        self._pending: list[tuple[C.Handle, list[torch.Tensor]]] = []
        self.wait_s = 0.0
        """Seconds blocked on receives since the last :meth:`reset_stats`."""
        self.sent_bytes = 0

    def send(self, tensor: torch.Tensor, dst_stage: int, label: str, private: bool = False) -> None:
        """Queue ``tensor`` for stage ``dst_stage``; returns at once.

        The tensor is copied first unless ``private`` says nobody else will write it (nor free it early). On a
        transport whose sends may block, it is posted with this stage's next receives (see the module doc).
        """
        payload = tensor.detach()
        if not private or not payload.is_contiguous():
            payload = payload.clone(memory_format=torch.contiguous_format)
        message = Message(payload, self.topology.stage_rank(dst_stage), label)
        self.sent_bytes += payload.numel() * payload.element_size()
        if self.transport.batches:
            self._outbox.append(message)
            return
        self._pending += [(h, [payload]) for h in self.transport.post([message], [])]
        if len(self._pending) > 64:
            self._reap()

    def recv_many(
        self, specs: Sequence[tuple[tuple[int, ...], torch.dtype, int]], device: torch.device, label: str
    ) -> list[torch.Tensor]:
        """Receive one tensor per ``(shape, dtype, src_stage)``, posting every receive before waiting on any
        (and, on a batching transport, in one group with the sends held back so far)."""
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in specs]
        recvs = [Message(buf, self.topology.stage_rank(src), label) for buf, (_, _, src) in zip(buffers, specs)]
        sends, self._outbox = self._outbox, []
        handles = self.transport.post(sends, recvs)
        start = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.wait_s += time.perf_counter() - start
        return buffers

    def share_from(self, obj: Any, src_stage: int) -> Any:
        """Broadcast a small picklable object from stage ``src_stage`` to the whole replica.

        Held-back sends go out first: a stage waiting for one of them could not reach the broadcast."""
        self.flush()
        return broadcast_object(obj, src_in_group=src_stage, group=self.mp_group)

    def flush(self) -> None:
        """Post every held-back send now (without waiting for it)."""
        if self._outbox:
            sends, self._outbox = self._outbox, []
            self._pending += [(h, [m.tensor for m in sends]) for h in self.transport.post(sends, [])]

    def _reap(self) -> None:
        still = []
        for handle, payloads in self._pending:
            if handle.is_completed():
                handle.wait()
            else:
                still.append((handle, payloads))
        self._pending = still

    def wait_sends(self) -> None:
        """Post what is held back, then block until every send has left (their buffers are then freed)."""
        self.flush()
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
