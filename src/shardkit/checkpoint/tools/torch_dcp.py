"""Reader for ``shardkit checkpoint import`` of torch.distributed.checkpoint (DCP) checkpoints written by torch
FSDP / FSDP2 (or any DCP user) with ``get_state_dict`` + ``dcp.save({"model": ..., "optim": ...})``.

DCP flattens nested state with dots, so such a checkpoint holds::

    model.<fqn>                         a parameter or buffer (or <fqn> alone when the model state was saved bare)
    optim.state.<fqn>.<state name>      optimizer state of parameter <fqn> (exp_avg, exp_avg_sq, step, ...)
    optim.param_groups.<i>.<hyper>      hyper-parameters of group i (lr, betas, ...); ``.params`` lists its fqns

The index is read through the allow-list unpickler, tensors and the small non-tensor entries through
``torch.load(weights_only=True)``; tensors are read whole, at any saving world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from shardkit.checkpoint import safe_dcp
from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.tools.sources import ImportedState, clean_name
from shardkit.checkpoint.tools.store import load_in_this_process

_STATE, _GROUPS = "optim.state.", "optim.param_groups."


def read_torch_dcp(path: Path) -> ImportedState:
    """The model (and optimizer state by parameter name, when present) of the DCP checkpoint in ``path``."""
    entries = safe_dcp.read_metadata(path).state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    model_keys = [k for k in tensors if not k.startswith("optim.")]
    prefixed = bool(model_keys) and all(k.startswith("model.") for k in model_keys)
    target: dict[str, Any] = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in tensors.items()}
    target.update(
        {k: None for k, v in entries.items() if isinstance(v, BytesStorageMetadata) and k.startswith(_GROUPS)}
    )
    load_in_this_process(target, path)
    model = {clean_name(k[len("model.") :] if prefixed else k): target[k] for k in model_keys}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key in tensors:
        if key.startswith(_STATE):
            fqn, _, state_name = key[len(_STATE) :].rpartition(".")
            fqn = clean_name(fqn)
            if fqn not in model:
                raise CorruptCheckpointError(f"{path}: optimizer state {key!r} names no parameter of the model")
            state.setdefault(fqn, {})[state_name] = target[key]
    return ImportedState(model, state, _hparams(target, set(model), path))


def _hparams(target: dict[str, Any], names: set[str], path: Path) -> dict[str, dict[str, Any]]:
    """fqn -> its group's hyper-parameters, from ``optim.param_groups.<i>.<name>`` entries."""
    groups: dict[int, dict[str, Any]] = {}
    for key, value in target.items():
        if not key.startswith(_GROUPS):
            continue
        number, _, name = key[len(_GROUPS) :].partition(".")
        if not number.isdigit() or not name:
            raise CorruptCheckpointError(f"{path}: cannot read param group entry {key!r}")
        groups.setdefault(int(number), {})[name] = value
    out: dict[str, dict[str, Any]] = {}
    for index, group in sorted(groups.items()):
        params = group.pop("params", None)
        if not isinstance(params, list):
            raise CorruptCheckpointError(f"{path}: param group {index} lists no parameter names")
        for fqn in map(clean_name, params):
            if fqn not in names:
                raise CorruptCheckpointError(f"{path}: param group {index} names {fqn!r}, not a model parameter")
            out[fqn] = dict(group)
    return out
