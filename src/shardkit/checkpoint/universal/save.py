"""Saving the universal layout: a source's held tensors and optimizer state become DCP boxes and side files.

:func:`stage` asks the source what this rank writes (its share of every span) and, for an asynchronous save,
copies exactly those boxes into host memory; :func:`write_staged` writes them as one DCP store (a collective
over the given process group) plus this rank's optimizer side file. Nothing here touches ``meta.json``: the
orchestration in :mod:`shardkit.checkpoint.api` hashes and publishes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from shardkit.checkpoint import safe_dcp
from shardkit.checkpoint.errors import CheckpointError
from shardkit.checkpoint.universal.layout import DCP_DIR
from shardkit.checkpoint.universal.optim_state import optimizer_placements, spanned_placements
from shardkit.checkpoint.universal.placement import Placement, model_key
from shardkit.checkpoint.universal.plans import Piece, UniversalSavePlanner, pieces_for
from shardkit.checkpoint.universal.side import SideState
from shardkit.checkpoint.universal.source import Held, UniversalSource
from shardkit.checkpoint.universal.split import Split, write_tp_layout


@dataclass
class Staged:
    """What one rank writes: its boxes and its optimizer side file (None without an optimizer)."""

    pieces: list[Piece]
    side: Optional[SideState]
    #: The tensor-parallel parameters this rank holds a slab of (:mod:`.split`), recorded for inspection.
    splits: dict[str, tuple[torch.Size, Split]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this rank writes."""
        return sum(p.tensor.numel() * p.tensor.element_size() for p in self.pieces)


def model_placements(held: list[Held]) -> list[Placement]:
    """This replica's share of every held tensor, keyed ``model/<fqn>``."""
    return [p for h in held for p in spanned_placements(model_key, h, h.tensor)]


def check_held(held: list[Held], strategy: str) -> None:
    """Refuse held tensors whose spans overlap another's (two tensors claiming the same elements on one rank)."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for h in held:
        for span in h.spans:
            for lo, hi in seen.get(span.fqn, []):
                if span.start < hi and lo < span.stop:
                    raise CheckpointError(
                        f"the {strategy} checkpoint source reports elements [{max(lo, span.start)}, "
                        f"{min(hi, span.stop)}) of '{span.fqn}' in two held tensors; each element is held once per rank"
                    )
            seen.setdefault(span.fqn, []).append((span.start, span.stop))


def stage(source: UniversalSource, *, copy: bool) -> Staged:
    """What this rank writes; with ``copy``, every box copied to host memory (the live state may change after).

    Call after ``source.before_save()``; the caller calls ``source.after_save()`` once the pieces are written
    (or, with ``copy``, right after this returns)."""
    held = source.held()
    check_held(held, source.strategy)
    placements = model_placements(held)
    side: Optional[SideState] = None
    optimizer = source.local_optimizer()
    if optimizer is not None:
        more, side = optimizer_placements(source, held, optimizer)
        placements += more
    pieces = pieces_for(placements)
    if copy:
        copies = HostCopies()
        pieces = [dataclasses.replace(p, tensor=copies.copy(p.tensor)) for p in pieces]
        # The background writer reads these host tensors at once: every device-to-host copy must have landed.
        copies.wait()
    splits = {span.fqn: (span.shape, span.split) for h in held for span in h.spans if span.split is not None}
    return Staged(pieces, side, splits)


class HostCopies:
    """Copies of tensors in host memory, for a writer that reads them on another thread.

    A CUDA tensor is copied asynchronously into pinned memory (one stream's worth of copies overlap instead of
    each waiting for the last), and an event is recorded after each copy on that tensor's stream;
    :meth:`wait` blocks until every recorded event has passed. Host tensors are copied at once. Nothing a copy
    returns may be read before :meth:`wait`."""

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (complete only after :meth:`wait` when ``tensor`` is on CUDA)."""
        if not tensor.is_cuda:
            return tensor.detach().to("cpu", copy=True)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        self._events.append(event)
        return out

    def wait(self) -> None:
        """Block until every copy started by :meth:`copy` is complete."""
        for event in self._events:
            event.synchronize()
        self._events.clear()


def write_staged(directory: Path, staged: Staged, group: Optional[dist.ProcessGroup]) -> None:
    """Write the DCP store: a collective over ``group`` (default the world; no process group: this process alone).

    Every rank must reach it (run :func:`write_local` inside an agreement first); DCP itself gathers any rank's
    failure and raises on all of them."""
    safe_dcp.save_planned(directory / DCP_DIR, UniversalSavePlanner(staged.pieces), group)


def write_local(directory: Path, staged: Staged, rank: int) -> None:
    """This rank's files besides the DCP store (its optimizer side file; rank 0: the tensor-parallel layout); creates
    the store's folder."""
    (directory / DCP_DIR).mkdir(parents=True, exist_ok=True)
    if staged.side is not None:
        staged.side.write(directory, rank)
    if rank == 0 and staged.splits:
        write_tp_layout(directory, staged.splits)
