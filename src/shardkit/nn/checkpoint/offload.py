"""Saved activations kept in host memory between forward and backward (``checkpoint_wrapper(offload_to_cpu=True)``).

On CPU and every non-CUDA device a saved tensor is copied down synchronously through ``shardkit::to_host`` (so a
planned run on the meta device counts it as host memory) and copied back when backward needs it, as before.

A CUDA tensor is copied down asynchronously, so the forward does not stall the host once per saved tensor:

1. the copy goes into a page-locked host buffer on a side stream, which first waits for the stream that produced
   the tensor (it is complete when the copy starts);
2. the source is recorded on the side stream (``record_stream``): autograd drops it as soon as the pack returns, and
   the caching allocator must not hand its block to new work before the copy has read it;
3. an event recorded after the copy marks the host buffer complete; whatever reads the buffer waits on it first.
   The copy back waits on it on the stream that runs the backward (no host synchronisation), then uploads
   ``non_blocking`` from the pinned buffer, whose block torch's host allocator keeps until that upload has run.

The device operations are one :class:`CudaCopies` object, so a test can put a fake in its place that lands copies
only when they are waited for (as a GPU does) and checks the order above on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from shardkit.memory.offload import to_host


class CudaCopies:
    """The CUDA operations of an asynchronous offload: streams, events, pinned buffers and copies."""

    def handles(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` takes the asynchronous path (it lives on a CUDA device)."""
        return tensor.is_cuda

    def current_stream(self, device: torch.device) -> Any:
        """The stream work on ``device`` is queued on now (the producer in forward, the consumer in backward)."""
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device) -> Any:
        """A stream for the copies down (taken from torch's pool: cheap to ask for)."""
        return torch.cuda.Stream(device)

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory shaped like ``tensor``: what makes the copy down asynchronous."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)

    def copy_down(self, stream: Any, after: Any, host: torch.Tensor, tensor: torch.Tensor) -> Any:
        """Queue ``host.copy_(tensor)`` on ``stream`` behind the work ``after`` has queued; returns the event that
        marks the copy complete."""
        stream.wait_stream(after)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def keep_source(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` so far has run."""
        tensor.record_stream(stream)

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (on the device; the host does not block)."""
        stream.wait_event(event)

    def copy_up(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` uploaded to ``device`` on the current stream, asynchronously from pinned memory."""
        return host.to(device, non_blocking=True)


#: The device operations the wrapper uses (replaced in tests by a fake that runs on CPU).
CUDA_COPIES = CudaCopies()


@dataclass
class Offloaded:
    """A saved tensor in host memory: where it came from, the host copy, and (asynchronous copies only) the event
    after which the host copy is complete."""

    device: torch.device
    host: torch.Tensor
    done: Optional[Any] = None


class ActivationOffload:
    """The pack and unpack hooks of one checkpointed forward (``torch.autograd.graph.saved_tensors_hooks``).

    ``pin`` is the synchronous path's choice (page-locked host memory for the CPU tensors of a forward whose other
    inputs come from CUDA), as before. The side stream is taken at the first CUDA pack, on the forward's thread;
    the unpack may run on any autograd thread and uses only what the packed record holds and the stream current
    there."""

    def __init__(self, pin: bool, copies: Optional[CudaCopies] = None) -> None:
        self.pin = pin
        self.copies = copies if copies is not None else CUDA_COPIES
        self._side: dict[torch.device, Any] = {}

    def pack(self, tensor: torch.Tensor) -> Offloaded:
        """Start moving a saved tensor to host memory."""
        if not self.copies.handles(tensor):
            return Offloaded(tensor.device, to_host(tensor, pin=self.pin))
        device = tensor.device
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = self.copies.side_stream(device)
        source = tensor.detach()
        host = self.copies.host_buffer(source)
        done = self.copies.copy_down(side, self.copies.current_stream(device), host, source)
        self.copies.keep_source(source, side)
        return Offloaded(device, host, done)

    def unpack(self, packed: Offloaded) -> torch.Tensor:
        """The saved tensor back on its device, for backward."""
        if packed.done is None:
            return packed.host.to(packed.device, non_blocking=packed.host.is_pinned())
        self.copies.wait(self.copies.current_stream(packed.device), packed.done)
        return self.copies.copy_up(packed.host, packed.device)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that offloads what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


__all__ = ["CUDA_COPIES", "ActivationOffload", "CudaCopies", "Offloaded"]
