"""Optimizer state given whole (a full or universal checkpoint, loaded before the partition) cut to this rank's shards.

The optimizer steps one shard per original parameter (``flatten_parameters=False``); a state tensor shaped like the
original parameter is flattened, padded like the parameter and cut to this rank's shard. State already shaped like
the shard (a partial checkpoint saved at the same layout) and scalars (Adam's ``step``) are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.nn.fsdp.flat_param import FlatParamMeta


def shard_whole_state(
    state_dict: Mapping[str, Any], params: Sequence[nn.Parameter], meta_of: Mapping[int, FlatParamMeta]
) -> dict[str, Any]:
    """``state_dict`` (torch's format: state by index into ``params``, the optimizer's parameters in group order)
    with every whole-parameter state tensor replaced by this rank's shard of it."""
    state: dict[Any, Any] = {}
    for index, entry in state_dict["state"].items():
        param = params[int(index)] if int(index) < len(params) else None
        meta = meta_of.get(id(param)) if param is not None else None
        if meta is None or not isinstance(entry, Mapping):
            state[index] = entry
            continue
        state[index] = {key: _shard_of(value, meta) for key, value in entry.items()}
    return {**state_dict, "state": state}


def _shard_of(value: Any, meta: FlatParamMeta) -> Any:
    whole = meta.params[0].shape
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != whole:
        return value
    # (A one-element parameter's state looks like its shard too: cutting it gives rank 0 the value and the other
    # ranks padding, which no parameter reads.)
    flat = torch.zeros(meta.padded_numel, dtype=value.dtype, device=value.device)
    flat[: meta.numel].copy_(value.reshape(-1))
    return meta.local_shard(flat).clone()
