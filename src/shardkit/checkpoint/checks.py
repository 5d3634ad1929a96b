"""The checks ``load_checkpoint`` runs before reading anything: the index against this run, and every file's
size and SHA-256 (also offered alone as :func:`verify_checkpoint`, an fsck for checkpoints)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

from shardkit.checkpoint.adapters import Adapter
from shardkit.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.files import sha256
from shardkit.checkpoint.metadata import CheckpointInfo, CheckpointMeta, check_size, read_meta
from shardkit.checkpoint.universal import load as universal_load
from shardkit.checkpoint.universal.layout import LAYOUT
from shardkit.checkpoint.universal.source import UniversalSource

PathLike = Union[str, Path]


def verify_checkpoint(directory: PathLike) -> CheckpointInfo:
    """Check that ``directory`` is a complete checkpoint whose every file has its recorded size and SHA-256.

    Reads no tensors and needs no process group (an fsck for checkpoints). Raises
    :class:`CorruptCheckpointError` naming the first bad file; returns what the index records.

    Example::

        for path in sorted(Path("runs/exp1").glob("step_*")):
            verify_checkpoint(path)
    """
    path = Path(directory)
    meta = read_meta(path)
    verify_files(path, meta, rank=0, world_size=1)
    return CheckpointInfo(
        path=path,
        step=meta.step,
        data_position=None,
        world_size=meta.world_size,
        strategy=meta.strategy,
        extra=None,
        rng_restored=False,
        shardkit_version=meta.shardkit_version,
        torch_version=meta.torch_version,
    )


def held_and_names(source: UniversalSource) -> tuple[list[Any], list[str]]:
    held = source.held()
    return held, universal_load.held_names(source, held)


def check_meta(
    path: Path, adapter: Adapter, source: Optional[UniversalSource], world_size: int, scaler: Any
) -> CheckpointMeta:
    meta = read_meta(path)
    if meta.layout == LAYOUT:
        if source is None:
            raise IncompatibleCheckpointError(
                f"{path} is in the universal layout (saved by '{meta.strategy}'), which this run's "
                f"'{adapter.strategy}' cannot read yet; load it with a strategy that has a universal source"
            )
    elif meta.layout != adapter.layout:
        raise IncompatibleCheckpointError(
            f"{path} was saved by strategy '{meta.strategy}' (layout '{meta.layout}'), which this run's "
            f"'{adapter.strategy}' (layout '{adapter.layout}') cannot read; load it with the strategy that saved it"
        )
    elif meta.world_size != world_size and not (meta.resizable and adapter.resizable):
        raise IncompatibleCheckpointError(
            f"{path} was saved by '{meta.strategy}' at world size {meta.world_size}; its state is per rank, so it "
            f"loads only at world size {meta.world_size}, not {world_size}. Restart with {meta.world_size} ranks."
        )
    if scaler is not None and not meta.has_scaler:
        raise IncompatibleCheckpointError(f"{path} holds no scaler state; load it with scaler=None")
    return meta


def verify_files(path: Path, meta: CheckpointMeta, rank: int, world_size: int) -> None:
    for i, (name, record) in enumerate(meta.files.items()):
        if i % world_size != rank:
            continue
        file = path / name
        check_size(file, record.bytes)
        if sha256(file) != record.sha256:
            raise CorruptCheckpointError(
                f"{file} does not match the SHA-256 recorded when it was written: it is damaged. "
                "Load an earlier checkpoint."
            )


def optimizer_settings(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's settings (``lr``, ``betas``, ...; not its parameters), to compare after a load. Under an
    LR scheduler (``initial_lr`` set) the current ``lr`` is the schedule's, not the caller's choice: left out."""
    if optimizer is None:
        return []
    skip = {"params"}
    return [
        {key: value for key, value in group.items() if key not in skip | ({"lr"} if "initial_lr" in group else set())}
        for group in optimizer.param_groups
    ]


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements, incomparable types
        return a is not b


def warn_replaced_settings(before: list[dict[str, Any]], optimizer: Any, path: Path) -> None:
    """Warn, naming each one, when loading replaced settings the caller gave ``optimizer`` (a resumed run with a
    new learning rate keeps the saved one, as torch's ``load_state_dict`` does, which nothing else would say)."""
    changed = [
        f"param group {index}: {key} {old!r} -> {group[key]!r}"
        for index, (old_group, group) in enumerate(zip(before, optimizer_settings(optimizer)))
        for key, old in old_group.items()
        if key in group and _differs(old, group[key])
    ]
    if changed:
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        warnings.warn(
            f"load_checkpoint replaced this optimizer's settings with those saved in {path} ({shown}): a resumed "
            "run continues with the saved ones. To train with new settings, set them after loading, e.g. "
            "`for group in optimizer.param_groups: group['lr'] = new_lr` (and an LR scheduler's base_lrs).",
            stacklevel=3,
        )
