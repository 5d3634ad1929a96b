"""Which checkpoint ``load_checkpoint`` loads: the directory it was given, or under a folder of them the newest
one that passes verification, skipping (with a warning saying why) each newer one that does not."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable, Union

from shardkit.checkpoint import _collectives as comm
from shardkit.checkpoint.checks import verify_files
from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.metadata import META_FILE, CheckpointMeta, intact_checkpoints, resolve

PathLike = Union[str, Path]


def find_verified(
    directory_or_root: PathLike, check: Callable[[Path], CheckpointMeta], verify: bool, fall_back: bool
) -> tuple[Path, CheckpointMeta]:
    """The checkpoint to load and its index (``check`` reads and checks it), agreed by every rank (which must all
    name the same ``directory_or_root``):
    ``directory_or_root`` itself, or under a root the newest checkpoint that passes verification; with
    ``fall_back`` each one that fails is skipped with a warning on every rank."""
    rank, world_size = comm.rank_and_size()
    comm.check_same_target("load_checkpoint", Path(directory_or_root))
    candidates = _Candidates(Path(directory_or_root)) if rank == 0 else None
    while True:
        found = comm.agreed_from_zero(
            lambda: candidates.next() if candidates is not None else None, "load_checkpoint: find"
        )
        path, is_root = Path(found[0]), found[1]
        meta = comm.agreed(functools.partial(check, path), "load_checkpoint: metadata")
        if not verify:
            return path, meta
        try:
            comm.agreed(functools.partial(verify_files, path, meta, rank, world_size), "load_checkpoint: verify")
        except CorruptCheckpointError as err:
            if not (is_root and fall_back):
                raise
            warnings.warn(f"load_checkpoint: skipping {path}, which failed verification ({err})", stacklevel=3)
            if candidates is not None:
                candidates.skipped.append(path)
            continue
        return path, meta


class _Candidates:
    """Rank 0's walk over the checkpoints to try: the directory itself, or a root's intact ones, newest first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_root = not (path / META_FILE).exists()
        self.walk = intact_checkpoints(path) if self.is_root else iter([path])
        self.skipped: list[Path] = []

    def next(self) -> tuple[str, bool]:
        found = next(self.walk, None)
        if found is not None:
            return str(found), self.is_root
        if not self.skipped:
            return str(resolve(self.path)), self.is_root  # raises, saying why nothing is there
        raise CorruptCheckpointError(
            f"no intact checkpoint under {self.path}: {', '.join(map(str, self.skipped))} failed verification "
            "(see the warnings above). Restore a checkpoint or start from scratch."
        )
