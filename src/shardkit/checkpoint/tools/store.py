"""Read the tensors of any shardkit checkpoint one at a time, whatever its layout.

A :class:`CheckpointView` lists every tensor a checkpoint holds (key, full shape, dtype, bytes, how many stored
chunks, which file) from the indexes alone, and :meth:`CheckpointView.read` materialises one tensor at a time,
so tools that walk a checkpoint (inspect, export) hold at most one full tensor plus what they choose to keep.

Layouts:

- ``universal``: torch.distributed.checkpoint (DCP) stores whose keys are ``model/<fqn>`` and
  ``optim/<fqn>/<state name>``; read key by key through :mod:`~shardkit.checkpoint.safe_dcp`'s allow-list index
  reader and ``torch.load(weights_only=True)``.
- ``fsdp-dcp``: a DCP store ``model/`` keyed by the unwrapped model's names, plus ``optimizer.pt``.
- ``full``: ``model.pt`` and ``optimizer.pt`` (``torch.save``), opened with ``mmap=True`` so only the tensor read
  is paged in.
- ``per-rank`` (SlowMo): ``slowmo/rank_<r>.pt``; the model is rank 0's copy.

Example::

    view = CheckpointView.open("runs/exp1/step_00000100")
    for entry in view.model_entries():
        tensor = view.read(entry)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardkit.checkpoint import safe_dcp
from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError
from shardkit.checkpoint.files import safe_load
from shardkit.checkpoint.metadata import CheckpointMeta, read_meta, resolve
from shardkit.checkpoint.universal.placement import MODEL_PREFIX, OPTIM_PREFIX

#: Which part of the training state a tensor belongs to.
MODEL, OPTIMIZER, OTHER = "model", "optimizer", "other"
_DCP_INDEX = ".metadata"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, described from its index (nothing is read)."""

    #: The key as stored (``model/fc.weight`` in a universal store, ``state/0/exp_avg`` in ``optimizer.pt``).
    key: str
    #: The unwrapped model's name for model tensors (``fc.weight``), else the key.
    name: str
    part: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: Stored pieces (DCP chunks); 1 for ``torch.save`` files.
    chunks: int
    #: The file or DCP store holding it, relative to the checkpoint directory.
    where: str

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


def dcp_stores(directory: Path) -> list[Path]:
    """Every DCP store (a folder with a ``.metadata`` index) at or one level under ``directory``, sorted."""
    found = [directory] if (directory / _DCP_INDEX).is_file() else []
    found += sorted(p for p in directory.iterdir() if p.is_dir() and (p / _DCP_INDEX).is_file())
    return found


def load_in_this_process(target: dict[str, Any], store: Path) -> None:
    """Fill ``target`` from the DCP store ``store`` in this process alone, even inside a job with a process group
    (the tools must not turn a read into a collective other ranks never join). The index goes through the
    allow-list unpickler and tensors through ``torch.load(weights_only=True)``, as in :mod:`safe_dcp`."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                target,
                storage_reader=safe_dcp.SafeFileSystemReader(store),
                planner=safe_dcp.SafeLoadPlanner(),
                no_dist=True,
            )
    except dcp.CheckpointException as err:
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        first = failures[0] if failures else err
        if isinstance(first, CheckpointError):
            raise type(first)(f"{store}: {first}") from err
        raise CorruptCheckpointError(f"{store} cannot be read: {type(first).__name__}: {first}") from err


def read_dcp_tensors(store: Path, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """The full tensors of ``entries`` (all in the DCP store ``store``), assembled from whatever chunks were saved
    (any saving world size), in one pass over the store."""
    target: dict[str, Any] = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    load_in_this_process(target, store)
    return target


def dcp_entries(where: str, metadata: Metadata, strip_prefix: bool) -> list[TensorEntry]:
    """Entries of the tensors in a DCP store's index (``strip_prefix``: universal ``model/``/``optim/`` keys)."""
    out = []
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        name, part = key, MODEL
        if strip_prefix:
            if key.startswith(MODEL_PREFIX):
                name = key[len(MODEL_PREFIX) :]
            else:
                part = OPTIMIZER if key.startswith(OPTIM_PREFIX) else OTHER
        out.append(TensorEntry(key, name, part, tuple(item.size), item.properties.dtype, len(item.chunks), where))
    return out


def _tensor_items(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in nested dicts/lists, paths joined with ``/``."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensor_items(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensor_items(v, f"{prefix}/{i}" if prefix else str(i))


def load_mapped(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)``: tensors stay in the file until touched."""

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return safe_load(path, what)  # the same read, with the checkpoint module's explanation of what failed


#: ``torch.save`` files holding tensors, per layout: (file, part; ``None``: SlowMo's per-rank file). In the
#: universal layout every tensor is in the DCP store (SlowMo's per-rank files there are for resuming SlowMo only).
_FILES: dict[str, tuple[tuple[str, Optional[str]], ...]] = {
    "full": (("model.pt", MODEL), ("optimizer.pt", OPTIMIZER)),
    "fsdp-dcp": (("optimizer.pt", OPTIMIZER),),
    "per-rank": (("slowmo/rank_00000.pt", None),),
}


class CheckpointView:
    """The tensors of one checkpoint directory, listed from its indexes and read one at a time."""

    def __init__(self, directory: Path, meta: CheckpointMeta) -> None:
        self.directory = directory
        self.meta = meta
        self._stores: dict[str, Path] = {}
        self._files: dict[str, Any] = {}
        self._entries = self._list()

    @staticmethod
    def open(directory_or_root: Union[str, Path]) -> CheckpointView:
        """The checkpoint at ``directory_or_root`` (or the latest complete one under it)."""
        directory = resolve(directory_or_root)
        return CheckpointView(directory, read_meta(directory))

    def entries(self) -> list[TensorEntry]:
        """Every tensor, in the order of the indexes."""
        return list(self._entries)

    def model_entries(self) -> list[TensorEntry]:
        """The model's parameters and buffers (for SlowMo: rank 0's copy)."""
        return [e for e in self._entries if e.part == MODEL]

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor of ``entry`` (a fresh CPU tensor)."""
        return self.read_many([entry])[entry.key]

    def read_many(self, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
        """Key -> full tensor of each of ``entries`` (one pass per DCP store; the caller bounds how many)."""
        out: dict[str, torch.Tensor] = {}
        for where in dict.fromkeys(e.where for e in entries):
            mine = [e for e in entries if e.where == where]
            if where in self._stores:
                out.update(read_dcp_tensors(self._stores[where], mine))
                continue
            wanted = {e.key for e in mine}
            for key, value in _tensor_items(self._file(where), ""):
                if key in wanted:
                    out[key] = value.clone()
            missing = wanted - out.keys()
            if missing:
                raise CorruptCheckpointError(f"{self.directory / where} has no tensor {sorted(missing)[0]!r}")
        return out

    def _file(self, name: str) -> Any:
        if name not in self._files:
            self._files[name] = load_mapped(self.directory / name, name)
        return self._files[name]

    def _list(self) -> list[TensorEntry]:
        layout = self.meta.layout
        out: list[TensorEntry] = []
        for store in dcp_stores(self.directory):
            where = str(store.relative_to(self.directory)) if store != self.directory else "."
            self._stores[where] = store
            metadata = safe_dcp.read_metadata(store)
            out += dcp_entries(where, metadata, strip_prefix=layout != "fsdp-dcp")
        for name, part in _FILES.get(layout, ()):
            if (self.directory / name).is_file():
                out += self._file_entries(name, part)
        return out

    def _file_entries(self, name: str, part: Optional[str]) -> list[TensorEntry]:
        obj = self._file(name)
        out = []
        for key, value in _tensor_items(obj, ""):
            this_part, short = part, key
            if part is None:  # SlowMo's rank file: {"model": wrapper state, "optimizer": ..., ...}
                head, _, rest = key.partition("/")
                this_part = MODEL if head == "model" and rest != "ps_weight" else OTHER
                short = _strip_module(rest) if this_part == MODEL else key
            out.append(TensorEntry(key, short, this_part or OTHER, tuple(value.shape), value.dtype, 1, name))
        return out


def _strip_module(name: str) -> str:
    """A wrapper's parameter name without its ``module.`` level (``module.fc.weight`` -> ``fc.weight``)."""
    return name[len("module.") :] if name.startswith("module.") else name
