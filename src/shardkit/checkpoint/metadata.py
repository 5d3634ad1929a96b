"""``meta.json``, the file that completes a checkpoint, and finding the newest complete checkpoint.

A checkpoint is a directory. Its ``meta.json`` is written last (after every other file is on disk and fsynced)
and records step, world size, strategy and the size and SHA-256 of every file, and the SHA-256 of its own
contents (``meta_sha256``), so an edited step or world size is caught like a damaged file. A directory without
it, or whose name starts with a dot (a save in progress), is not a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from shardkit.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardkit.checkpoint.files import sha256

META_FILE = "meta.json"
FORMAT = "shardkit-checkpoint"
FORMAT_VERSION = 1
#: The strategy ``shardkit checkpoint import`` records: weights from another tool, no training state of a run.
IMPORTED_STRATEGY = "import"
#: The key of ``meta.json`` holding the SHA-256 of the rest of it (absent from checkpoints written before it).
DIGEST_KEY = "meta_sha256"


def index_digest(obj: dict[str, Any]) -> str:
    """SHA-256 of a ``meta.json`` object without its own digest, in a canonical JSON form (key order and spacing
    do not matter, values do)."""
    body = {key: value for key, value in obj.items() if key != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """Size and SHA-256 of one file of a checkpoint."""

    bytes: int
    sha256: str


def record_files(directory: Path, rank: int = 0, world_size: int = 1) -> dict[str, FileRecord]:
    """Size and SHA-256 of the files under ``directory``, by path relative to it, in sorted order; with
    ``world_size`` > 1 only this ``rank``'s share (every ``world_size``-th file), so ranks can split the hashing.

    Example::

        files = record_files(Path("runs/step_100"))     # what meta.json records
    """
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    return {
        name: FileRecord((directory / name).stat().st_size, sha256(directory / name))
        for i, name in enumerate(names)
        if i % world_size == rank
    }


@dataclass(frozen=True)
class CheckpointMeta:
    """The contents of ``meta.json``."""

    step: int
    world_size: int
    strategy: str
    layout: str
    resizable: bool
    has_optimizer: bool
    has_scaler: bool
    shardkit_version: str
    torch_version: str
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``meta.json``, sealed with its own digest."""
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        return {**body, DIGEST_KEY: index_digest(body)}

    @staticmethod
    def from_json(obj: Any, where: Path) -> CheckpointMeta:
        """Parse ``meta.json``'s object, or raise :class:`CorruptCheckpointError` saying what is off."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where} is not a shardkit checkpoint index")
        if obj.get("format_version") != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where} has checkpoint format version {obj.get('format_version')}, this shardkit reads "
                f"{FORMAT_VERSION}; load it with the shardkit version that wrote it ({obj.get('shardkit_version')})"
            )
        recorded = obj.get(DIGEST_KEY)
        if recorded is not None and recorded != index_digest(obj):
            raise CorruptCheckpointError(
                f"{where} was changed after it was written: its contents no longer match the SHA-256 recorded in it "
                f"({DIGEST_KEY}), so its step, world size or file list cannot be trusted. Restore the original "
                "file, or load an earlier checkpoint (load_checkpoint(root) falls back to the newest intact one)."
            )
        try:
            files = {name: FileRecord(**record) for name, record in obj["files"].items()}
            outside = [name for name in files if Path(name).is_absolute() or ".." in Path(name).parts]
            if outside:
                raise CorruptCheckpointError(f"{where} lists files outside the checkpoint: {outside[:3]}")
            fields = {k: obj[k] for k in CheckpointMeta.__dataclass_fields__ if k != "files"}
            return CheckpointMeta(files=files, **fields)
        except (KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{where} is a damaged checkpoint index ({err!r})") from None


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`~shardkit.checkpoint.load_checkpoint` restored, besides the model and optimizer."""

    #: The checkpoint directory that was loaded.
    path: Path
    #: The training step given to ``save_checkpoint``.
    step: int
    #: This rank's ``data_position`` when the world size is unchanged, else rank 0's.
    data_position: Any
    #: The world size the checkpoint was saved at.
    world_size: int
    #: The strategy that saved it (``"plain"``, ``"ddp"``, ``"oss"``, ``"oss_sdp"``, ``"fsdp"``, ``"smp"``,
    #: ``"slowmo"``).
    strategy: str
    #: The ``extra`` object given to ``save_checkpoint``.
    extra: Any
    #: Whether this rank's random generators were restored (only at the saving world size).
    rng_restored: bool
    #: The shardkit version that wrote it.
    shardkit_version: str
    #: The torch version that wrote it.
    torch_version: str


def read_meta(directory: Path) -> CheckpointMeta:
    """The checkpoint index of ``directory``; :class:`CorruptCheckpointError` if it is incomplete or damaged."""
    path = directory / META_FILE
    if not path.is_file():
        raise CorruptCheckpointError(
            f"{directory} is not a complete checkpoint: it has no {META_FILE}, which is written last, so its save "
            "was interrupted. Load an earlier one (latest_checkpoint(root) skips incomplete checkpoints)."
        )
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{path} cannot be parsed ({err}); the checkpoint index is damaged") from None
    return CheckpointMeta.from_json(obj, path)


def check_sizes(directory: Path, meta: CheckpointMeta) -> None:
    """Raise :class:`CorruptCheckpointError` if a file ``meta`` records is missing or has another size (a stat per
    file: the cheap part of verification, which the SHA-256 comparison completes)."""
    for name, record in meta.files.items():
        check_size(directory / name, record.bytes)


def check_size(file: Path, written_bytes: int) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``file`` exists with the ``written_bytes`` its record gives."""
    if not file.is_file():
        raise CorruptCheckpointError(f"{file} is missing; the checkpoint was damaged after it was written")
    size = file.stat().st_size
    if size != written_bytes:
        raise CorruptCheckpointError(
            f"{file} has {size} bytes, {written_bytes} were written: it is truncated or damaged. "
            "Load an earlier checkpoint."
        )


def _indexed(root: Path) -> list[tuple[int, str, Path]]:
    """``(step, name, directory)`` of the children of ``root`` with a ``meta.json``, newest first; a damaged index is
    reported (the directory is skipped), a directory without one is an interrupted save or not a checkpoint."""
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not (child / META_FILE).exists():
            continue
        try:
            found.append((read_meta(child).step, child.name, child))
        except CorruptCheckpointError as err:
            _skipped(child, err)
    return sorted(found, reverse=True)


def _skipped(directory: Path, err: CorruptCheckpointError) -> None:
    warnings.warn(f"skipping checkpoint {directory}: {err}", stacklevel=3)


def intact_checkpoints(root: Union[str, Path], hashes: bool = False) -> Iterator[Path]:
    """The complete checkpoints directly under ``root`` that pass verification, newest first (lazily).

    Each has a readable ``meta.json`` matching its digest and every recorded file at its recorded size; with
    ``hashes`` every file's SHA-256 is compared too (reads every byte). Each checkpoint that fails is skipped
    with a warning saying why.
    """
    root = Path(root)
    if not root.is_dir():
        return
    for _, _, directory in _indexed(root):
        try:
            meta = read_meta(directory)
            check_sizes(directory, meta)
            for name, record in meta.files.items() if hashes else ():
                if sha256(directory / name) != record.sha256:
                    raise CorruptCheckpointError(
                        f"{directory / name} does not match the SHA-256 recorded when it was written: it is damaged"
                    )
        except CorruptCheckpointError as err:
            _skipped(directory, err)
            continue
        yield directory


def latest_checkpoint(root: Union[str, Path], hashes: bool = False) -> Optional[Path]:
    """The newest intact checkpoint directory directly under ``root`` (highest step), or ``None``.

    Directories without ``meta.json`` (interrupted saves) and hidden ones (saves in progress) are not
    checkpoints. A checkpoint whose ``meta.json`` is damaged or edited, or whose files are missing or truncated,
    is skipped with a warning naming it and the reason; ``hashes=True`` also compares every file's SHA-256 (reads
    every byte; ``load_checkpoint`` does that anyway). Equal steps are broken by name.

    Example::

        path = latest_checkpoint("runs/exp1")
        if path is not None:
            info = load_checkpoint(path, model=model, optimizer=optimizer)
    """
    return next(intact_checkpoints(root, hashes), None)


def resolve(directory_or_root: Union[str, Path]) -> Path:
    """A checkpoint directory itself, or the latest complete checkpoint under a root."""
    path = Path(directory_or_root)
    if (path / META_FILE).exists():
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if path.is_dir() and any(child.is_file() for child in path.iterdir()):
        read_meta(path)  # files but no index: an interrupted save, say so
    raise CheckpointNotFoundError(
        f"no complete checkpoint at or under {path}: pass a directory written by save_checkpoint, or its parent"
    )
