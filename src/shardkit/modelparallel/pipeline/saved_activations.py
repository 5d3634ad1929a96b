"""The tensors a stage's forwards save for backward, held in slots the split backward can empty after B.

Under a zero-bubble schedule a micro-batch's graph lives from its F to its W. Left alone, autograd would keep
every saved tensor that long, although W needs only those of the nodes it runs again: the *boundary* nodes
(where a weight's gradient leaves the input-gradient path) and the nodes between them and the weights. The
others (attention probabilities, activation functions' inputs, the loss's softmax: the *B-only* tensors) are
used by B for the last time. So every forward of a split schedule runs under this module's saved-tensor hooks:
each saved tensor goes into a :class:`_Slot`, and B records which slots its non-boundary nodes unpacked (a
pre-hook and a post-hook on each boundary node tell the two kinds of node apart). Those slots are emptied
when B ends. Each slot belongs to exactly one graph node, and W never runs a non-boundary input-side node,
so W never needs an emptied slot; should it ever try, the unpack raises instead of computing with nothing.

The same slots count bytes (each storage once, parameters excluded): :attr:`SavedActivations.saved` counts
the saved tensors, what every schedule keeps for backward, and :attr:`SavedActivations.total` adds the
gradients W still has to consume, which only a split backward keeps (an unsplit one also makes them, but
only for the moment its backward runs, which these counts do not see). Each has a live and a peak value
since :meth:`SavedActivations.reset_peak`; the benchmark reads them to compare schedules' activation memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.graph import Node

from shardkit.nn._torch_private import view_base


class _Slot:
    """One saved tensor; :meth:`release` drops this stage's reference to it."""

    __slots__ = ("_owner", "key", "nbytes", "tensor")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self._owner, self.key, self.nbytes = owner, key, nbytes
        self.tensor: Optional[torch.Tensor] = tensor
        owner.saved.add(key, nbytes)
        owner.total.add(key, nbytes)

    def release(self) -> None:
        if self.tensor is not None:
            self.tensor = None
            self._owner.saved.remove(self.key, self.nbytes)
            self._owner.total.remove(self.key, self.nbytes)

    def __del__(self) -> None:
        # A module compiled in place (``module.compile()``) may have dynamo trace the pack hook, which can leave
        # a slot whose ``__init__`` never ran: it holds nothing to release.
        if hasattr(self, "tensor"):
            self.release()


class _Recording:
    """What one B unpacked: slots of non-boundary nodes (``used``) and of boundary nodes (``kept``)."""

    def __init__(self) -> None:
        self.used: list[_Slot] = []
        self.kept: set[int] = set()
        self.inside_boundary = 0


class ByteCount:
    """Live and peak bytes of storages that have holders, each storage counted once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._holders: dict[int, int] = {}

    def add(self, key: int, nbytes: int) -> None:
        """Storage ``key`` gains a holder."""
        count = self._holders.get(key, 0)
        self._holders[key] = count + 1
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def remove(self, key: int, nbytes: int) -> None:
        """Storage ``key`` loses a holder."""
        count = self._holders.pop(key, 0) - 1
        if count > 0:
            self._holders[key] = count
        elif count == 0:
            self.live -= nbytes


class SavedActivations:
    """Saved-tensor hooks of one stage: slots for every saved tensor, their bytes, and B-only freeing."""

    def __init__(self) -> None:
        self.saved = ByteCount()
        """The tensors saved for backward."""
        self.total = ByteCount()
        """The saved tensors and the gradients kept for W."""
        # The B being recorded. A plain attribute, not thread-local: on CUDA autograd runs the nodes (and so
        # the unpack hook) on its own device thread. Nodes of two threads overlapping can only make a slot
        # count as a boundary's and be kept, never the other way round.
        self._recording: Optional[_Recording] = None

    def reset_peak(self) -> None:
        """Start new peaks from what is alive now."""
        for count in (self.saved, self.total):
            count.peak = count.live

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a forward runs under so its saved tensors go into slots."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """Count ``tensors`` (gradients kept for W) as live; returns what to give :meth:`drop` later."""
        held = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
        for key, nbytes in held:
            self.total.add(key, nbytes)
        return held

    def drop(self, held: Sequence[tuple[int, int]]) -> None:
        """Stop counting what :meth:`hold` returned."""
        for key, nbytes in held:
            self.total.remove(key, nbytes)

    def _pack(self, tensor: torch.Tensor) -> Any:
        viewed = view_base(tensor)
        base = viewed if viewed is not None else tensor
        storage = tensor.untyped_storage()
        if isinstance(base, nn.Parameter) or storage.nbytes() == 0:
            return tensor  # a weight is no activation, and freeing this reference would free nothing
        # Detached: a node saving its own output would otherwise hold itself through the slot (a cycle).
        return _Slot(self, tensor.detach(), storage.data_ptr(), storage.nbytes())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Slot):
            return packed
        if packed.tensor is None:
            raise RuntimeError(
                "a tensor saved for backward was freed after the input-gradient half (B) of a split backward but "
                "the weight-gradient half (W) needs it: please report this with the model; "
                "'pipeline': 'interleaved' avoids the split meanwhile"
            )
        recording = self._recording
        if recording is not None:
            if recording.inside_boundary:
                recording.kept.add(id(packed))
            else:
                recording.used.append(packed)
        return packed.tensor

    @contextmanager
    def freeing_after(self, boundaries: Sequence[Node]) -> Iterator[None]:
        """Around B: record the slots unpacked outside ``boundaries`` (the nodes W runs again) and empty them
        when B has run."""
        recording = _Recording()

        def enter(_: Any) -> None:
            recording.inside_boundary += 1

        def leave(_: Any, __: Any) -> None:
            recording.inside_boundary -= 1

        handles = [n.register_prehook(enter) for n in boundaries] + [n.register_hook(leave) for n in boundaries]
        previous, self._recording = self._recording, recording
        try:
            yield
        finally:
            self._recording = previous
            for handle in handles:
                handle.remove()
        for slot in recording.used:
            if id(slot) not in recording.kept:
                slot.release()
