"""Where one FSDP tree communicates: the reduce-scatter channels and, on CUDA, the side streams.

The root builds one :class:`CommContext` at its first forward and every unit of its tree uses it:

- **Channels.** Reduce-scatters go to a second process group over the same ranks as the parameter group, so a
  gradient reduction never waits behind all-gathers that prefetch the next unit (on NCCL a process group runs
  its collectives one after another on one stream). Dummy and size-one groups get no channel.
- **Streams.** When tensors are on CUDA, gathers and reductions (and the casts and copies around them) are
  issued on their own streams, so they overlap the kernels of the compute stream; waiting for them makes the
  compute stream wait on the side stream. On CPU there are no streams: every method below is a no-op and
  overlap comes from the asynchronous work handles of gloo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from shardkit.distributed.groups import GroupLike


class SideStream:
    """A CUDA stream per device for one kind of communication; a no-op for tensors on any other device."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        """The side stream for ``device`` (created on first use), or None off CUDA."""
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            self._streams[index] = stream
        return stream

    @contextlib.contextmanager
    def issue(self, device: torch.device) -> Iterator[Optional[torch.cuda.Stream]]:
        """Run the block on the side stream, after everything already queued on the current stream."""
        stream = self.get(device)
        if stream is None:
            yield None
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream


def join(stream: Optional[torch.cuda.Stream]) -> None:
    """Make the current stream wait for the work queued on ``stream`` (nothing on CPU)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


class CommContext:
    """Per FSDP tree: reduce channels by parameter group, and the gather and reduce side streams."""

    def __init__(self, reduce_channels: Optional[dict[int, GroupLike]] = None) -> None:
        #: ``id(parameter group)`` -> the process group its reduce-scatters run on.
        self.reduce_channels: dict[int, GroupLike] = dict(reduce_channels or {})
        self.gather = SideStream()
        self.reduce = SideStream()

    def reduce_channel(self, group: GroupLike) -> GroupLike:
        """The group to reduce-scatter gradients of ``group`` on (``group`` itself when it has no channel)."""
        return self.reduce_channels.get(id(group), group)
