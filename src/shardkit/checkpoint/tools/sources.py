"""Readers for ``shardkit checkpoint import``: plain state dicts, safetensors, and fairscale FSDP checkpoints.

Each reader is a pure function from files to an :class:`ImportedState` (model tensors by the unwrapped model's
names, optionally optimizer state by parameter name); nothing is unpickled beyond what
``torch.load(weights_only=True)`` accepts, and ``torch.save`` files are opened with ``mmap=True`` so their tensors
stay in the file until written out.

fairscale FSDP checkpoints, in the two forms fairscale writes:

- **consolidated**: ``torch.save(model.state_dict())`` of a fairscale FSDP model (full weights); any
  ``_fsdp_wrapped_module.``/``_fpw_module.`` levels left in the names are removed.
- **local shards**: one ``torch.save`` file per rank holding that rank's ``model.local_state_dict()`` and
  ``model.local_metadata_dict()``, as a dict ``{"model" | "weights" | "state_dict": <local state dict>,
  "shard_metadata" | "meta" | "metadata": <local metadata dict>}`` (fairseq's ``checkpoint*-shard<r>.pt`` and the
  layout of fairscale's own ``consolidate_shard_weights`` tests). Files are ordered by the number after ``rank`` or
  ``shard`` in their names. The metadata is ``{"param_metadata": [{"fsdp_path": str, "params": {flat name:
  {"names": [...], "shapes": [...], "numels": [...], "padding": int}}, "no_broadcast_optim_state": bool,
  "shared_param_info": [(src, dst), ...]}, ...], "buffer_names": [...]}``: each flat parameter's shards are, in
  rank order, the flat parameter's consecutive pieces, each with ``padding`` trailing elements (only rank 0's when
  ``no_broadcast_optim_state``); the unpadded concatenation holds the original parameters in ``names`` order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.tools.store import load_mapped

#: Wrapper levels fairscale and torch insert into parameter names; never part of a user's model.
WRAPPER_LEVELS = frozenset({"_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module", "_orig_mod"})
_MODEL_KEYS = ("model", "state_dict", "module", "weights")
_META_KEYS = ("shard_metadata", "meta", "metadata")


@dataclass
class ImportedState:
    """Tensors read from another tool's checkpoint, by the unwrapped model's names."""

    #: fqn -> parameter or buffer.
    model: dict[str, torch.Tensor]
    #: fqn -> optimizer state name (``exp_avg``, ``step``, ...) -> tensor.
    optim_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: fqn -> hyper-parameters of its param group (``lr``, ``betas``, ...).
    optim_hparams: dict[str, dict[str, Any]] = field(default_factory=dict)


def clean_name(name: str) -> str:
    """``name`` without wrapper levels (``_fsdp_wrapped_module.layer._fpw_module.weight`` -> ``layer.weight``)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_LEVELS)


def _tensor_dict(obj: Any, where: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CorruptCheckpointError(
            f"{where} does not hold a state dict of tensors; pass --key NAME for the entry that holds the model's"
        )
    return {str(k): v for k, v in obj.items()}


def _pick(obj: Any, key: Optional[str], where: Path) -> Any:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            raise CorruptCheckpointError(f"{where} has no entry {key!r}")
        return obj[key]
    if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for name in _MODEL_KEYS:
            if isinstance(obj.get(name), Mapping):
                return obj[name]
    return obj


def _clean_all(state: Mapping[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Wrapper levels removed; a ``module.`` level on every name (torch DDP's) removed too."""
    out = {clean_name(k): v for k, v in state.items()}
    if len(out) != len(state):
        raise CorruptCheckpointError(f"{where}: names collide once wrapper levels are removed")
    if all(k.startswith("module.") for k in out):
        out = {k[len("module.") :]: v for k, v in out.items()}
    return out


def read_state_dict(path: Path, key: Optional[str] = None) -> ImportedState:
    """A ``torch.save`` state dict (``model.state_dict()``, a fairscale consolidated one, or a dict holding it
    under ``key`` / ``model`` / ``state_dict``), read with ``weights_only=True`` and ``mmap=True``."""
    obj = load_mapped(path, "state dict")
    return ImportedState(_clean_all(_tensor_dict(_pick(obj, key, path), path), path))


def safetensors_files(path: Path) -> list[Path]:
    """A ``.safetensors`` file, or the files of a folder (through its ``*.safetensors.index.json`` if it has one)."""
    if path.is_file():
        return [path]
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map", {})
        return [path / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CorruptCheckpointError(f"{path} holds no .safetensors files")
    return files


def read_safetensors(path: Path) -> ImportedState:
    """A safetensors file or folder (HF shards), tensor by tensor."""
    from safetensors import safe_open

    model: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name in model:
                    raise CorruptCheckpointError(f"{file}: tensor {name!r} appears in two files")
                model[name] = handle.get_tensor(name)
    return ImportedState(_clean_all(model, path))


def _rank_of(path: Path) -> int:
    found = re.findall(r"(?:rank|shard)[-_]?(\d+)", path.name)
    if not found:
        raise CorruptCheckpointError(f"{path.name}: cannot tell its rank (name it like rank-0.pt or shard0.pt)")
    return int(found[-1])


def _shard_parts(obj: Any, where: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if not isinstance(obj, Mapping):
        raise CorruptCheckpointError(f"{where} is not a fairscale shard file (a dict with weights and metadata)")
    weights = next((obj[k] for k in _MODEL_KEYS if k in obj), None)
    meta = next((obj[k] for k in _META_KEYS if k in obj), None)
    if not isinstance(weights, Mapping) or not isinstance(meta, Mapping) or "param_metadata" not in meta:
        raise CorruptCheckpointError(
            f"{where} lacks fairscale's local state dict ('model'/'weights') or its local_metadata_dict() "
            "('shard_metadata'/'meta'); save both per rank"
        )
    return {clean_name(str(k)): v for k, v in weights.items()}, dict(meta)


def _flat_piece(shards: list[torch.Tensor], pads: list[int], start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the unpadded concatenation of ``shards``, copying only those elements."""
    pieces, offset = [], 0
    for shard, pad in zip(shards, pads):
        real = shard.view(-1)[: shard.numel() - pad]
        lo, hi = max(start, offset), min(stop, offset + real.numel())
        if lo < hi:
            pieces.append(real[lo - offset : hi - offset])
        offset += real.numel()
    if offset < stop:
        raise CorruptCheckpointError(f"the shards hold {offset} elements, the metadata needs {stop}")
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0].clone()


def read_fairscale_shards(files: list[Path]) -> ImportedState:
    """fairscale FSDP local shards (one file per rank; format in the module docstring), consolidated one
    original parameter at a time."""
    ordered = sorted(files, key=_rank_of)
    ranks = [_rank_of(f) for f in ordered]
    if ranks != list(range(len(ranks))):
        raise CorruptCheckpointError(f"fairscale shards for ranks {ranks} found; every rank 0..N-1 is needed")
    parts = [_shard_parts(load_mapped(f, "fairscale shard"), f) for f in ordered]
    weights, metas = [p[0] for p in parts], [p[1] for p in parts]
    model: dict[str, torch.Tensor] = {}
    shared: list[tuple[str, str]] = []
    for index, unit in enumerate(metas[0]["param_metadata"]):
        path = unit["fsdp_path"]
        shared += [(str(src), str(dst)) for src, dst in unit.get("shared_param_info", [])]
        for flat_name, info in unit["params"].items():
            key = f"{path}.{flat_name}" if path else flat_name
            owners = 1 if unit.get("no_broadcast_optim_state") else len(weights)
            missing = [r for r in range(owners) if key not in weights[r]]
            if missing:
                raise CorruptCheckpointError(f"{ordered[missing[0]]} has no {key!r}, which its metadata lists")
            shards = [weights[r][key] for r in range(owners)]
            pads = [int(metas[r]["param_metadata"][index]["params"][flat_name]["padding"]) for r in range(owners)]
            offset = 0
            for name, shape, numel in zip(info["names"], info["shapes"], info["numels"]):
                full = f"{path}.{name}" if path else name
                model[full] = _flat_piece(shards, pads, offset, offset + int(numel)).view(tuple(shape))
                offset += int(numel)
    for src, dst in shared:
        model[dst] = model[src]
    for name in metas[0].get("buffer_names", []):
        if name in weights[0]:
            model[name] = weights[0][name]
    return ImportedState(model)
