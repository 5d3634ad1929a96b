"""Saving and loading Lightning checkpoints of a fully sharded model, in the two formats the strategy offers.

``"full"``: one file, written by rank 0 through Lightning's CheckpointIO. ``state_dict`` holds the unwrapped
model's parameters, ``optimizer_states`` the optimizer state of the full model (gathered from the shards), so
the file loads at any world size, and into a model trained without shardkit.

``"sharded"``: a folder written by ``torch.distributed.checkpoint`` (DCP); every rank writes only its part.
The model is FSDP's :func:`~shardkit.nn.fsdp.state_dict.sharded_state_dict` (one row-sharded ``DTensor`` per
original parameter, loadable at any world size). The optimizer state stays in the flat-shard layout the
optimizer steps in: each state tensor shaped like a flat shard is saved as a ``DTensor`` sharded on dimension 0
over the ranks, which ties it to the world size it was saved at. Everything that is not a tensor (loop progress,
callbacks, the optimizers' param groups) goes to ``meta.pt`` from rank 0. Resume a sharded checkpoint with the
same number of processes; save ``"full"`` to change it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from shardkit.checkpoint import safe_dcp
from shardkit.checkpoint.files import safe_load
from shardkit.distributed import collectives
from shardkit.nn.fsdp import layout
from shardkit.nn.fsdp.state_dict import get_shard_from_optim_state_dict, load_sharded_state_dict, sharded_state_dict

if TYPE_CHECKING:
    from shardkit.nn.fsdp import FullyShardedDataParallel

META_FILE = "meta.pt"
_MODEL_KEY = "model"
_PARAM_GROUPS = "shardkit_optimizer_param_groups"
#: Marks a checkpoint dict read from a sharded folder (its entries are shards, not full tensors).
_SHARDED_FLAG = "shardkit_sharded"


def _optim_key(index: int) -> str:
    return f"optimizer_{index}"


def _inner(optimizer: Optimizer) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer


# ----------------------------------------------------------------------------- what goes into a checkpoint
def model_state(root: FullyShardedDataParallel, state_dict_type: str) -> dict[str, Any]:
    """The model entry of a checkpoint (a collective): the full state dict, or per-parameter DTensors."""
    if state_dict_type == "full":
        return dict(root.state_dict())
    return dict(sharded_state_dict(root))


def optimizer_state(
    root: FullyShardedDataParallel, optimizer: Optimizer, state_dict_type: str, is_global_zero: bool
) -> dict[str, Any]:
    """One ``optimizer_states`` entry: the full model's optimizer state on rank 0 ("full", a collective every
    rank joins; ``{}`` elsewhere) or this rank's shard state ("sharded")."""
    optimizer = _inner(optimizer)
    if state_dict_type == "full":
        full = root.gather_full_optim_state_dict(optimizer)
        return dict(full) if is_global_zero and full is not None else {}
    return optimizer.state_dict()


def load_model_state(root: FullyShardedDataParallel, checkpoint: Mapping[str, Any], strict: bool) -> None:
    """Load the model entry of a checkpoint read by :func:`load_sharded` or from a full file."""
    state = checkpoint["state_dict"]
    if checkpoint.get(_SHARDED_FLAG):
        load_sharded_state_dict(root, state, strict=strict)
    else:
        root.load_state_dict(state, strict=strict)


def load_optimizer_states(
    root: FullyShardedDataParallel, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any]
) -> None:
    """Load ``optimizer_states`` into the sharded optimizers, after :func:`load_model_state`."""
    states = checkpoint.get("optimizer_states")
    if states is None:
        return
    if len(states) != len(optimizers):
        raise RuntimeError(
            f"the checkpoint holds the state of {len(states)} optimizers but configure_optimizers returned "
            f"{len(optimizers)}; resume with the same optimizers"
        )

    for optimizer, state in zip(optimizers, states):
        optimizer = _inner(optimizer)
        if checkpoint.get(_SHARDED_FLAG):
            optimizer.load_state_dict(state)
        else:
            optimizer.load_state_dict(get_shard_from_optim_state_dict(root, state, optimizer))


# ----------------------------------------------------------------------------- sharded (DCP) format
def is_sharded(path: Any) -> bool:
    """True when ``path`` is a folder written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file()


def _mesh(root: FullyShardedDataParallel) -> Any:
    """A one-dimensional mesh over the world, on the device type the shards (and their optimizer state) use."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_shard_device(root).type, (dist.get_world_size(),))


def _as_dtensors(state: Any, mesh: Any, shard_numels: set[int]) -> Any:
    """Wrap 1-D tensors as long as a flat shard in DTensors sharded on dim 0; keep everything else.

    A buffer that happens to have a shard's length is saved per rank too, which round-trips just as well.
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(state, torch.Tensor):
        if state.dim() == 1 and state.numel() in shard_numels:
            return DTensor.from_local(state, mesh, [Shard(0)], run_check=False)
        return state
    if isinstance(state, Mapping):
        return {str(k): _as_dtensors(v, mesh, shard_numels) for k, v in state.items()}
    return state


def _shard_numels(root: FullyShardedDataParallel) -> set[int]:
    return {flat.meta.shard_numel for flat in layout(root).flats}


def save_sharded(root: FullyShardedDataParallel, checkpoint: dict[str, Any], path: Any, is_global_zero: bool) -> None:
    """Write ``checkpoint`` (whose model/optimizer entries are local shards) as a DCP folder plus ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.is_file():
        raise FileExistsError(f"{path} is a file; a sharded checkpoint is a folder. Remove it or pick another name.")
    path.mkdir(parents=True, exist_ok=True)
    numels = _shard_numels(root)
    mesh = _mesh(root)
    tensors = {_MODEL_KEY: checkpoint.pop("state_dict")}
    param_groups = []
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[_optim_key(index)] = _as_dtensors(state["state"], mesh, numels)
        param_groups.append(state["param_groups"])
    dcp.save(tensors, checkpoint_id=str(path))
    if is_global_zero:
        torch.save({**checkpoint, _PARAM_GROUPS: param_groups}, path / META_FILE)
    collectives.barrier(label="lightning.save_sharded")


def load_sharded(root: FullyShardedDataParallel, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
    """Read a folder written by :func:`save_sharded` into a Lightning checkpoint holding this rank's shards."""
    path = Path(path)
    # Safe by default (as torch >= 2.6 and Lightning are): only an explicit weights_only=False unpickles objects;
    # otherwise a meta.pt carrying pickled objects raises UnsafeCheckpointError without running them.
    if weights_only is False:
        meta: dict[str, Any] = torch.load(path / META_FILE, weights_only=False)
    else:
        meta = safe_load(path / META_FILE, "Lightning checkpoint metadata")
    param_groups = meta.pop(_PARAM_GROUPS)
    template = _template(root, path, len(param_groups))
    try:
        safe_dcp.load(template, path)  # DCP's index is read through an allow-list unpickler
    except Exception as exc:
        raise RuntimeError(
            f"could not load the sharded checkpoint {path} into this run ({exc}). A sharded checkpoint resumes "
            "only with the same model, optimizers and number of processes; save with state_dict_type='full' to "
            "change them."
        ) from exc
    meta["state_dict"] = template[_MODEL_KEY]
    meta["optimizer_states"] = [
        {"state": {int(k): v for k, v in _to_local(template[_optim_key(i)]).items()}, "param_groups": groups}
        for i, groups in enumerate(param_groups)
    ]
    meta[_SHARDED_FLAG] = True
    return meta


def _template(root: FullyShardedDataParallel, path: Path, num_optimizers: int) -> dict[str, Any]:
    """Placeholders shaped like this rank's part of the checkpoint, for DCP to fill in place.

    The model's come from its sharded state dict. Optimizer state is created lazily at the first step, so the
    optimizers may have none yet: those placeholders are built from the checkpoint's metadata instead.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor, Shard

    # The index first, through the allow-list unpickler: a tampered one is refused before any collective.
    metadata = safe_dcp.read_metadata(path).state_dict_metadata
    mesh = _mesh(root)
    template: dict[str, Any] = {_MODEL_KEY: dict(sharded_state_dict(root))}
    world = dist.get_world_size()
    for index in range(num_optimizers):
        prefix = f"{_optim_key(index)}."
        state: dict[str, dict[str, Any]] = {}
        for fqn, item in metadata.items():
            if not fqn.startswith(prefix):
                continue
            param_id, name = fqn[len(prefix) :].split(".", 1)
            value: Any = None
            if isinstance(item, TensorStorageMetadata):
                dtype = item.properties.dtype
                if len(item.chunks) > 1:
                    local = torch.empty(item.size[0] // world, dtype=dtype, device=_shard_device(root))
                    value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
                else:
                    value = torch.empty(item.size, dtype=dtype)
            state.setdefault(param_id, {})[name] = value
        template[_optim_key(index)] = state
    return template


def _shard_device(root: FullyShardedDataParallel) -> torch.device:
    """Where the shards, and the optimizer state shaped like them, live."""
    return layout(root).flats[0].shard.device


def _to_local(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, Mapping):
        return {k: _to_local(v) for k, v in state.items()}
    return state
