"""torch.distributed.checkpoint (DCP) with reading made safe.

DCP stores tensors in ``.distcp`` files (read with ``torch.load(weights_only=True)``), but it reads its
``.metadata`` index with a plain ``pickle.load`` and non-tensor entries with ``torch.load(weights_only=False)``:
either would run code from a tampered checkpoint. Here the index is unpickled by an allow-list that knows only
DCP's own metadata classes, ``torch.Size``, dtypes and paths, and non-tensor entries go through
``weights_only=True``; anything else raises :class:`~shardkit.checkpoint.errors.UnsafeCheckpointError` before it
is built.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.futures import Future

from shardkit.checkpoint._torch_private import DCP_INDEX_PRIVATE_GLOBALS
from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from shardkit.checkpoint.files import write_failure

_METADATA_FILE = ".metadata"
_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_META: {
        "Metadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds only the classes a DCP index is made of; refuses every other global before importing it."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or name in DCP_INDEX_PRIVATE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"the DCP index names {module}.{name}, which is not part of a torch.distributed.checkpoint index; "
            "the file was refused unread (it could run code)"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP index of the checkpoint in ``path``, unpickled through the allow-list."""
    file = path / _METADATA_FILE
    if not file.is_file():
        raise CorruptCheckpointError(f"{path} holds no DCP index ({_METADATA_FILE}): the sharded state is incomplete")
    try:
        with open(file, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{file}: {err}") from None
    except Exception as err:
        raise CorruptCheckpointError(f"{file} cannot be read ({type(err).__name__}: {err}); it is damaged") from err
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{file} is not a DCP index (it holds a {type(metadata).__name__})")
    return metadata


def global_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Key -> full shape of every tensor in the DCP checkpoint at ``path`` (non-tensor entries are left out)."""
    shapes = {}
    for key, entry in read_metadata(path).state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            shapes[key] = tuple(entry.size)
    return shapes


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose index is read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"DCP entry {read_item.dest_index.fqn} holds pickled objects torch.load(weights_only=True) refuses"
            ) from err
        replacement = io.BytesIO()
        torch.save(loaded, replacement)
        replacement.seek(0)
        super().load_bytes(read_item, replacement)  # re-serialised plain data: safe to hand to torch's reader


class ExplainingFileSystemWriter(FileSystemWriter):
    """DCP's file writer, whose failures name this rank's file and the OS-level cause (:func:`write_failure`).

    Explained here, on the rank that failed: DCP then gathers the failure to every rank by pickling it, which drops
    the exception's context, where the cause (``OSError: File too large``) sits behind torch's own message."""

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            raise write_failure(_rank_file(Path(self.path), plan.storage_data.prefix), err) from err


def _rank_file(directory: Path, prefix: str) -> Path:
    """The file this rank was writing (the one with its prefix; the pattern when it wrote several)."""
    written = sorted(directory.glob(f"{prefix}*.distcp"))
    return written[0] if len(written) == 1 else directory / f"{prefix}*.distcp"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` (DTensors and tensors) as a DCP checkpoint in ``path``; collective; files are fsynced."""
    writer = FileSystemWriter(path, sync_files=True)
    with _single_process_is_intended():
        dcp.save(state, storage_writer=writer, no_dist=_no_dist())


def load(state: dict[str, Any], path: Path) -> None:
    """Fill ``state`` in place from the DCP checkpoint in ``path`` (any saving world size); collective."""
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=_no_dist())
    except CheckpointException as err:
        raise _explain(err, path) from err


def save_planned(path: Path, planner: Any, process_group: Any = None) -> None:
    """Run DCP's save into ``path`` with ``planner`` (which says what to write); files are fsynced.

    Collective over ``process_group`` (default: the world; without a process group, this process alone). DCP
    gathers every rank's failure; it is raised on every rank as a :class:`CheckpointError`."""
    try:
        with _single_process_is_intended():
            dcp.save(
                {},
                storage_writer=ExplainingFileSystemWriter(path, sync_files=True),
                planner=planner,
                process_group=process_group,
                no_dist=_no_dist(),
            )
    except CheckpointException as err:
        failures = {rank: f[0] if isinstance(f, tuple) else f for rank, f in err.failures.items()}
        if not failures:
            raise CheckpointError(f"writing {path} failed: {err}") from err
        if _no_dist():
            raise _said(next(iter(failures.values())), path) from err
        ranks = ", ".join(str(rank) for rank in sorted(failures))
        lines = [f"rank {rank}: {_said(failure, path)}" for rank, failure in sorted(failures.items())]
        raise CheckpointError(f"writing {path} failed on rank(s) {ranks}:\n" + "\n".join(lines)) from err


def _said(failure: BaseException, path: Path) -> CheckpointError:
    """One rank's DCP write failure: the writer's own explanation (:class:`ExplainingFileSystemWriter`), or DCP's."""
    if isinstance(failure, CheckpointError):
        return CheckpointError(str(failure))
    return CheckpointError(f"writing {path} failed: {type(failure).__name__}: {failure}")


def load_planned(path: Path, planner: Any, process_group: Any = None) -> None:
    """Run DCP's load of ``path`` with ``planner`` (which says what to read and where) through the safe reader.

    Collective over ``process_group`` (default: the world). A failure on any rank raises our error types on every
    rank."""
    try:
        with _single_process_is_intended():
            dcp.load(
                {},
                storage_reader=SafeFileSystemReader(path),
                planner=planner,
                process_group=process_group,
                no_dist=_no_dist(),
            )
    except CheckpointException as err:
        raise _explain(err, path) from err


def _explain(err: CheckpointException, path: Path) -> Exception:
    """DCP gathers every rank's failure into one exception; surface the first, keeping our error types."""
    failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    for failure in failures:
        if isinstance(failure, (UnsafeCheckpointError, CorruptCheckpointError)):
            return type(failure)(f"{path}: {failure}")
    first = failures[0] if failures else err
    return CorruptCheckpointError(
        f"torch.distributed.checkpoint could not read {path}: {type(first).__name__}: {first}"
    )


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is the intent, not a slip."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "global_shapes",
    "load",
    "load_planned",
    "read_metadata",
    "save",
    "save_planned",
]
