"""Atomic, verified, safe-to-load training checkpoints for every shardkit strategy.

``save_checkpoint`` writes the whole training state (model, optimizer, grad scaler, step, every rank's RNG
states, data position) of plain/DDP, OSS, OSS + ShardedDataParallel, FSDP, smp or SlowMo training into one
directory; ``load_checkpoint`` restores it, at another world size where the strategy allows (all but SlowMo);
``latest_checkpoint`` finds the newest complete one, so a job restarted by torchrun's elastic agent resumes
where it stopped.

One layout for every strategy (:mod:`~.universal`): model and optimizer state as DCP shards keyed by the
unwrapped model's names, each rank writing only what it holds, so any strategy loads any other's checkpoint at any
world size without gathering on one rank. Tensor-parallel models (``shardkit.tensor_parallel`` layers, alone or
under DDP, FSDP or OSS over the data-parallel group) save each rank's slice of a split parameter as chunks of the
full tensor, so they load at another tensor-parallel degree or without tensor parallelism (:mod:`~.universal.split`).
``save_checkpoint(..., async_save=True)`` returns once this rank's share is staged in host memory
(:func:`wait_for_checkpoint`). Checkpoints of the earlier layouts still load.

Guarantees:

- **Atomic.** Files are written into a hidden sibling directory, fsynced, indexed by ``meta.json`` (written last,
  with each file's size and SHA-256) and renamed into place. A crash mid-save leaves the previous checkpoint
  intact and the partial one invisible to :func:`latest_checkpoint`.
- **Verified.** Loading checks sizes and digests (``meta.json`` carries its own), then reads and validates
  everything on every rank before writing anything: a truncated file, an edited ``meta.json``, another model's
  checkpoint or a wrong world size raises a :class:`CheckpointError` naming the file or key on every rank, and
  changes nothing. Given a folder, :func:`latest_checkpoint` and ``load_checkpoint`` skip a damaged checkpoint
  with a warning and use the newest intact one.
- **Safe.** Files are read with ``torch.load(weights_only=True)`` and DCP indices by an allow-list unpickler: a
  file carrying arbitrary pickled objects is refused (:class:`UnsafeCheckpointError`) without running any code.

Example::

    from shardkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_directory

    start = 0
    if latest_checkpoint(root) is not None:
        info = load_checkpoint(root, model=model, optimizer=optimizer, scaler=scaler)
        start = info.step + 1
    for step in range(start, total_steps):
        train_step(step)
        if step % 50 == 0:
            save_checkpoint(step_directory(root, step), step=step, model=model, optimizer=optimizer, scaler=scaler)

Pieces: :mod:`~.api` (the two entry points), :mod:`~.universal` (the layout engine), :mod:`~.adapters` (one
file per strategy: its universal source and its legacy reader), :mod:`~.metadata`
(``meta.json``, :func:`latest_checkpoint`), :mod:`~.files` (durable writes, safe reads), :mod:`~.safe_dcp`
(DCP with a safe reader), :mod:`~.validate` (key and shape checks), :mod:`~.rng`.
"""

from shardkit.checkpoint.api import load_checkpoint, save_checkpoint, step_directory, verify_checkpoint
from shardkit.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
)
from shardkit.checkpoint.files import safe_load
from shardkit.checkpoint.metadata import CheckpointInfo, latest_checkpoint
from shardkit.checkpoint.universal.background import wait_for_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "UnsafeCheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "safe_load",
    "save_checkpoint",
    "step_directory",
    "verify_checkpoint",
    "wait_for_checkpoint",
]
