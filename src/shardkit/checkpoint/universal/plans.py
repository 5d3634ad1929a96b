"""DCP save and load planners for the universal layout: one DCP chunk per memory-contiguous box.

A :class:`Piece` is one box of one layout key with the local tensor view that holds it. Saving, every piece a rank
writes becomes a ``WriteItem`` whose chunk carries the box's offsets and sizes and the key's full shape, so the
store is an ordinary DCP checkpoint of full-shaped tensors. Loading, every piece a rank needs is matched against
whatever chunks were saved (any world size, any strategy) with torch's chunk-overlap helper, and DCP copies each
overlap straight into the piece's view: no rank ever builds a full tensor it does not hold; DCP's per-item read
buffer is the only staging. Saved chunks are at most :data:`MAX_CHUNK_BYTES`, so that buffer stays small whatever
the size of one tensor (DCP's reader keeps at most two chunks alive at once).
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardkit.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.universal.placement import Placement
from shardkit.utils.torch_compat import dcp_save_needs_full_cover_on_one_rank


@dataclass(frozen=True)
class Piece:
    """One box of layout key ``key`` (full shape ``shape``) and the local view ``tensor`` shaped like the box."""

    key: str
    shape: torch.Size
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.sizes)


def pieces_of(placement: Placement) -> list[Piece]:
    """The boxes of ``placement`` with their views of its local tensor (an empty tensor: one empty box)."""
    if math.prod(placement.shape) == 0:
        empty = placement.local.detach().reshape(-1)[:0].reshape(placement.shape)
        return [Piece(placement.key, placement.shape, (0,) * len(placement.shape), tuple(placement.shape), empty)]
    return [
        Piece(placement.key, placement.shape, box.offsets, box.sizes, view.detach()) for box, view in placement.boxes()
    ]


#: The largest DCP chunk a save writes; a larger box is split along its outermost dimension (a loader reads a chunk
#: at a time into a buffer of its size).
MAX_CHUNK_BYTES = 32 * 2**20


def split_piece(piece: Piece, max_bytes: int = MAX_CHUNK_BYTES) -> list[Piece]:
    """``piece`` as boxes of at most ``max_bytes`` each (itself when it is small enough), each still contiguous.

    The box is cut along its first dimension longer than one (the dimensions before it have size one, so every
    part is a contiguous run of the view); a part whose single slice is still too large is cut further inside.

    Example::

        >>> parts = split_piece(Piece("model/w", torch.Size([8, 4]), (0, 0), (8, 4), torch.zeros(8, 4)), 48)
        >>> [(p.offsets, p.sizes) for p in parts]
        [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (2, 4))]
    """
    element = piece.tensor.element_size()
    if piece.numel * element <= max_bytes:
        return [piece]
    dim = next(d for d, size in enumerate(piece.sizes) if size > 1)
    slice_bytes = math.prod(piece.sizes[dim + 1 :]) * element
    step = max(1, max_bytes // slice_bytes)
    parts: list[Piece] = []
    for lo in range(0, piece.sizes[dim], step):
        length = min(step, piece.sizes[dim] - lo)
        offsets = (*piece.offsets[:dim], piece.offsets[dim] + lo, *piece.offsets[dim + 1 :])
        sizes = (*piece.sizes[:dim], length, *piece.sizes[dim + 1 :])
        part = Piece(piece.key, piece.shape, offsets, sizes, piece.tensor.narrow(dim, lo, length))
        parts += split_piece(part, max_bytes)
    return parts


def pieces_for(placements: Iterable[Placement]) -> list[Piece]:
    """Every box of every placement."""
    return [piece for placement in placements for piece in pieces_of(placement)]


class UniversalSavePlanner(DefaultSavePlanner):
    """Writes exactly the given pieces as DCP chunks of their keys, each at most ``max_chunk_bytes`` (larger pieces
    are split; the state dict handed to DCP is empty)."""

    def __init__(self, pieces: Sequence[Piece], max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        # A box several ranks write (buffers, whose replicas may differ: BatchNorm statistics after a local
        # forward) is kept from the lowest rank, as a save from rank 0 would; distinct boxes are unaffected.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        parts = [part for piece in pieces for part in split_piece(piece, max_chunk_bytes)]
        self._pieces = {(p.key, tuple(p.offsets)): p for p in parts}
        if len(self._pieces) != len(parts):
            raise ValueError("two pieces of the same key start at the same offsets: the placements overlap")

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for piece in self._pieces.values():
            offsets = torch.Size(piece.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(piece.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.sizes)),
                        properties=TensorProperties(dtype=piece.tensor.dtype),
                        size=piece.shape,
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if len(all_plans) > 1 or not dcp_save_needs_full_cover_on_one_rank():
            return super().create_global_plan(all_plans)
        # One rank may write part of a key (a tool writing one rank's share, a store with a shard left out to test
        # the loader's refusal); torch before 2.9 refuses that plan, later releases check the cover only across
        # ranks. The plan is built as torch builds it, with the checks a one-rank plan gets there.
        global_plan, metadata = create_default_global_save_plan(all_plans)
        check_boxes(metadata)
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return exact_storage(self._pieces[(write_item.index.fqn, tuple(write_item.index.offset or ()))].tensor)


def check_boxes(metadata: Metadata) -> None:
    """Refuse a save plan with a chunk outside its tensor or two chunks of a key that overlap (a store whose
    chunks would contradict each other on load)."""
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        for chunk in entry.chunks:
            if any(o < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size)):
                raise ValueError(f"'{key}' of shape {tuple(entry.size)} has a chunk out of bounds: {chunk}")
        # Chunks sorted along the first dimension: each is compared only with those it may still meet there.
        active: list[ChunkStorageMetadata] = []
        for chunk in sorted((c for c in entry.chunks if math.prod(c.sizes)), key=lambda c: tuple(c.offsets)):
            if entry.size:
                active = [a for a in active if a.offsets[0] + a.sizes[0] > chunk.offsets[0]]
            for other in active:
                if _overlap(chunk.offsets, chunk.sizes, other.offsets, other.sizes):
                    raise ValueError(f"'{key}' has overlapping chunks {other} and {chunk}")
            active.append(chunk)


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` as a tensor whose storage is exactly its own bytes, sharing memory with it (no copy).

    DCP's writer clones every tensor whose storage is larger than the tensor (``torch.save`` of a view would write
    the whole storage) and keeps each clone alive until the rank's file is closed: for boxes that are views into a
    flat shard (FSDP) or a replica's share of a parameter (OSS), that was a second copy of everything the rank
    writes. An alias built over the view's own bytes gives DCP nothing to clone. Host tensors only (a CUDA tensor
    is copied to the host by DCP anyway); returns ``view`` itself where no alias can be built.

    Example::

        >>> flat = torch.arange(12.0)
        >>> box = exact_storage(flat[4:10].view(2, 3))
        >>> box.untyped_storage().nbytes(), box.data_ptr() == flat[4:].data_ptr()
        (24, True)
    """
    if view.device.type != "cpu" or not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes:
        return view
    if view.numel() == 0:
        return view.detach().clone()
    try:
        as_bytes = view.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # no numpy, or a dtype numpy cannot show as bytes: let DCP clone it
        return view
    return torch.from_numpy(as_bytes).view(view.dtype).view(view.shape)


class UniversalLoadPlanner(LoadPlanner):
    """Reads exactly the given pieces (each a view to fill) from whatever chunks the store holds."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self._by_key: dict[str, list[Piece]] = defaultdict(list)
        for piece in pieces:
            if piece.numel:  # an empty box reads nothing (its key's presence and shape were checked)
                self._by_key[piece.key].append(piece)
        self._metadata: Optional[Metadata] = None

    def set_up_planner(
        self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        self._metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self._metadata is not None
        items: list[ReadItem] = []
        for key, pieces in self._by_key.items():
            entry = self._metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)
            chunks = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in pieces]
            items += create_read_items_for_chunk_list(key, entry, chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CorruptCheckpointError(f"entry {read_item.dest_index.fqn} is not a tensor; the universal layout has none")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index.index  # the position of the piece in its key's list (set by the plan)
        assert index is not None
        view = self._by_key[read_item.dest_index.fqn][index].tensor
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def _overlap(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]) -> int:
    volume = 1
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        volume *= max(0, min(ao + asz, bo + bsz) - max(ao, bo))
    return volume


def check_pieces(pieces: Iterable[Piece], metadata: Metadata, store: Path, what: dict[str, str]) -> None:
    """Refuse, before anything is read, pieces the store cannot fill.

    Checks per piece: its key is stored as a tensor of the same full shape, the saved chunks cover the whole box,
    and every chunk it needs sits in a file that exists and is long enough. ``what`` maps a key to how to name
    it in an error (e.g. which parameter of this model asked for it).
    """
    storage = getattr(metadata, "storage_data", None) or {}
    for piece in pieces:
        entry = metadata.state_dict_metadata.get(piece.key)
        name = what.get(piece.key, piece.key)
        if entry is None:
            raise IncompatibleCheckpointError(
                f"{store}: {name} needs key '{piece.key}', which the checkpoint does not hold; it was saved from "
                "another model (or without this state). Load it into the model that saved it."
            )
        if not isinstance(entry, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{store}: key '{piece.key}' is not a tensor")
        if tuple(entry.size) != tuple(piece.shape):
            raise IncompatibleCheckpointError(
                f"{store}: {name} has shape {tuple(piece.shape)} here but the checkpoint's '{piece.key}' has shape "
                f"{tuple(entry.size)}; load it into a model of the same configuration"
            )
        covered = 0
        for chunk in entry.chunks:
            shared = _overlap(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes) if piece.sizes else 1
            if shared == 0:
                continue
            covered += shared
            _check_chunk_file(store, storage, MetadataIndex(piece.key, chunk.offsets))
        if covered < piece.numel:
            raise CorruptCheckpointError(
                f"{store}: the saved chunks of '{piece.key}' cover only {covered} of the {piece.numel} elements at "
                f"offsets {piece.offsets} (sizes {piece.sizes}) that {name} needs: a shard is missing"
            )


def _check_chunk_file(store: Path, storage: dict[Any, Any], index: MetadataIndex) -> None:
    info = storage.get(index)
    if info is None:
        return  # torch's reader raises for it; the index is its own authority on where chunks live
    relative = Path(str(info.relative_path))
    if relative.is_absolute() or ".." in relative.parts:
        raise CorruptCheckpointError(f"{store}: the DCP index points outside the checkpoint ({relative})")
    file = store / relative
    if not file.is_file():
        raise CorruptCheckpointError(f"{file} is missing: a shard of '{index.fqn}' was deleted or never written")
    if file.stat().st_size < int(info.offset) + int(info.length):
        raise CorruptCheckpointError(f"{file} is shorter than the DCP index says: it is truncated")
