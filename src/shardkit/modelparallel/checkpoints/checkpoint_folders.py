"""``smp.save_checkpoint`` and ``smp.resume_from_checkpoint``: smp v1.10+'s checkpoint folders.

The layout, as smp documents it (``rankinfo`` is ``<pp_rank>_<tp_rank>``)::

    path/
      <tag>_partial/                one folder per partial checkpoint
        model_<pp>_<tp>.pt          the stage's ``model.local_state_dict()`` (its tensor-parallel rank's slices)
        optimizer_<pp>_<tp>.pt      the stage's ``optimizer.local_state_dict()`` (likewise)
        user_content.pt             what the script passed as ``user_content``
      <tag>                         a full checkpoint: the whole model's plain ``state_dict`` (slices merged)
      user_content_<tag>            its user content
      optimizer_<tag>               its optimizer's full ``state_dict`` (ours: smp lists no such file); under tensor
                                    or sharded data parallelism, where the state is sliced or sharded, only the fp16
                                    loss scaler's state (``{"loss_scaler": ...}``; no file without fp16)
      newest                        the tag saved last (text)

Every file is a plain ``torch.save`` of tensors and containers and is read back weights-only, so no pickled code
runs. ``newest`` is written after every rank has written its files, so a job killed while saving resumes from
the previous complete checkpoint. smp's documented layout has no optimizer file for a full checkpoint; here one is
written when an optimizer is given (so resuming from a full checkpoint does not silently restart the optimizer), and
resuming warns when it is absent.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from typing import Any, Callable, Optional

import torch

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.checkpoints.checkpoint_files import (
    NEWEST,
    USER_CONTENT,
    newest_tag,
    read_checkpoint,
    stage_name,
)
from shardkit.modelparallel.checkpoints.user_content import encode
from shardkit.modelparallel.precision.fp16_optimizer import SCALER_KEY
from shardkit.utils.tensors import to_cpu


def _check_user_content(user_content: Any) -> None:
    """Refuse, at save time, content that weights-only loading would refuse at resume time (``user_content`` is
    already encoded: see :mod:`~.user_content`)."""
    buffer = io.BytesIO()
    torch.save(user_content, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError or RuntimeError depending on the object
        raise TypeError(
            "smp.save_checkpoint: user_content must hold only tensors, dicts, lists, tuples, numbers, strings, None, "
            "NumPy scalars and arrays and transformers configs (checkpoints are loaded weights-only, so no pickled "
            f"code runs); got: {str(exc).splitlines()[0]}"
        ) from None


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: Optional[int] = None,
) -> None:
    """Write a checkpoint of ``model`` and ``optimizer`` under ``path`` as smp's ``<tag>_partial`` folder
    (``partial=True``) or ``<tag>`` file (``partial=False``), then record ``tag`` in ``path/newest``.

    Collective: call it on every rank with the same ``tag``. ``num_kept_partial_checkpoints`` deletes the
    oldest partial folders beyond that many. ``translate_if_full`` is accepted: the full state dict is already
    the wrapped module's own (a Hugging Face model's keys stay its keys).

    Example::

        smp.save_checkpoint("/opt/ml/checkpoints", tag=f"step{step}", model=model, optimizer=optimizer,
                            user_content={"step": step}, num_kept_partial_checkpoints=2)
    """
    if not isinstance(tag, str) or not tag or os.sep in tag:
        raise ValueError(f"smp.save_checkpoint: tag must be a non-empty file name, got {tag!r}")
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
        raise ValueError(f"num_kept_partial_checkpoints must be at least 1, got {num_kept_partial_checkpoints}")
    user_content = to_cpu(encode(user_content))
    _check_user_content(user_content)
    # Each tensor-parallel rank writes its slices; under sharded data parallelism each rank of the first sharding
    # group writes its shards.
    first_replica = smp_state.current().topology.rdp_rank < smp_state.current().config.sharded_data_parallel_degree
    if partial:
        folder = os.path.join(path, f"{tag}_partial")
        if first_replica:
            os.makedirs(folder, exist_ok=True)
            if model is not None:
                torch.save(to_cpu(model.local_state_dict()), os.path.join(folder, stage_name("model")))
            if optimizer is not None:
                torch.save(to_cpu(optimizer.local_state_dict()), os.path.join(folder, stage_name("optimizer")))
            if smp_state.rank() == 0:
                torch.save(user_content, os.path.join(folder, USER_CONTENT))
    else:
        full = model.state_dict() if model is not None else None  # collective over the replica's stages
        full_optimizer = optimizer.state_dict() if optimizer is not None and not _tp_slices_optimizer() else None
        scaler_state = getattr(optimizer, "loss_scaler_state", None)  # an smp.DistributedOptimizer's
        scale = scaler_state() if callable(scaler_state) else None
        if full_optimizer is None and scale is not None:
            full_optimizer = {SCALER_KEY: scale}  # the fp16 loss scale alone
        if smp_state.rank() == 0:
            os.makedirs(path, exist_ok=True)
            if full is not None:
                torch.save(to_cpu(full), os.path.join(path, tag))
            if full_optimizer is not None:
                torch.save(to_cpu(full_optimizer), os.path.join(path, f"optimizer_{tag}"))
            torch.save(user_content, os.path.join(path, f"user_content_{tag}"))
    smp_state.barrier()
    if smp_state.rank() == 0:
        _write_newest(path, tag)
        if partial and num_kept_partial_checkpoints is not None:
            _prune(path, tag, num_kept_partial_checkpoints)
    smp_state.barrier()


def _tp_slices_optimizer() -> bool:
    """Under tensor parallelism the optimizer state is sliced like the weights and a full checkpoint holds the
    merged model only (as smp's): warn that the optimizer is not in it."""
    state = smp_state.current()
    if state.config.sharded_data_parallel_degree > 1:
        warnings.warn(
            "smp.save_checkpoint(partial=False) with sharded_data_parallel_degree="
            f"{state.config.sharded_data_parallel_degree} saves the gathered model without the optimizer state (it is "
            "sharded over the sharding group); save a partial checkpoint to resume the optimizer too",
            stacklevel=3,
        )
        return True
    tp_size = state.topology.tp_size
    if tp_size > 1:
        warnings.warn(
            f"smp.save_checkpoint(partial=False) with tensor_parallel_degree={tp_size} saves the merged model without "
            "the optimizer state (it is sliced per tensor-parallel rank); save a partial checkpoint to resume the "
            "optimizer too",
            stacklevel=3,
        )
    return tp_size > 1


def _write_newest(path: str, tag: str) -> None:
    temporary = os.path.join(path, f".{NEWEST}.tmp")
    with open(temporary, "w", encoding="utf-8") as out:
        out.write(tag)
    os.replace(temporary, os.path.join(path, NEWEST))  # atomic: a reader sees the old tag or the new one


def _prune(path: str, keep_tag: str, keep: int) -> None:
    """Delete the oldest partial folders (by when their user content was written) beyond ``keep``."""
    folders = []
    for entry in os.listdir(path):
        marker = os.path.join(path, entry, USER_CONTENT)
        if entry.endswith("_partial") and os.path.isfile(marker) and entry != f"{keep_tag}_partial":
            folders.append((os.stat(marker).st_mtime_ns, entry))
    for _, entry in sorted(folders)[: max(0, len(folders) - (keep - 1))]:
        shutil.rmtree(os.path.join(path, entry))


def resume_from_checkpoint(
    path: str,
    tag: Optional[str] = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` (or smp v1.10+) into the smp model and optimizer;
    returns its user content.

    ``tag=None`` takes the one in ``path/newest``. Call it on every rank after creating the
    ``DistributedModel`` and ``DistributedOptimizer`` (before or after the first step). When any rank lacks a
    file it needs, every rank raises a ``FileNotFoundError`` naming them. ``translate_function`` maps a full
    state dict's keys to the model's; ``load_sharded_optimizer_state`` is accepted (optimizer state here is
    never sharded across replicas in the checkpoint).

    Example::

        user_content = smp.resume_from_checkpoint("/opt/ml/checkpoints")
        start_step = user_content["step"]
    """
    state = smp_state.current()
    model, optimizer = state.model, state.optimizer if load_optimizer else None
    if model is None:
        raise RuntimeError("smp.resume_from_checkpoint: create the smp.DistributedModel before resuming into it")
    loaded = read_checkpoint(path, tag, partial, optimizer is not None, "smp.resume_from_checkpoint")
    weights = loaded["model"]
    if not partial and translate_function is not None:
        weights = translate_function(weights)
    model.load_state_dict(weights, strict=strict)
    scale_only = loaded["optimizer"] is not None and "state" not in loaded["optimizer"]
    if optimizer is not None and scale_only:  # a full checkpoint under tensor/sharded data parallelism under fp16
        optimizer.load_loss_scaler_state(loaded["optimizer"].get(SCALER_KEY))
    if optimizer is not None and loaded["optimizer"] is not None and not scale_only:
        optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        warnings.warn(
            f"smp.resume_from_checkpoint: the full checkpoint {tag or newest_tag(path)!r} holds no optimizer state "
            "(it was saved without optimizer=), so the optimizer keeps its current state; pass "
            "load_optimizer=False if that is intended",
            stacklevel=2,
        )
    return loaded["user_content"]
