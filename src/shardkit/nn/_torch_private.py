"""The private torch names ``shardkit.nn`` (FSDP, ShardedDataParallel, SlowMo, activation checkpointing) uses,
imported here and nowhere else (the names shared with other packages are in ``shardkit.utils._torch_private``).

Every name here was checked present on torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27);
``tests/compat/test_torch_private.py`` resolves them on the running torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

# The base class of every batch norm (1d, 2d, 3d, sync, lazy); ``auto_wrap_bn`` wraps each instance. If it moves,
# ``auto_wrap_bn`` fails at its first call.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

# What ``Module.load_state_dict`` returns (a named tuple of missing and unexpected keys); FSDP's loaders return one
# so callers read it as they read torch's. If it moves, ``shardkit.nn.fsdp.state_dict`` stops importing.
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

#: The attribute torch's ``state_dict`` sets on the dict it returns: per module path, the module's version (and
#: what ``_load_from_state_dict`` reads back). FSDP's local layout, checkpoint_wrapper's and ShardedDataParallel's
#: key renaming keep it in step with the keys; if torch renamed it, they would silently stop doing so (versions of
#: renamed modules would be lost), which the compat test catches.
STATE_DICT_METADATA = "_metadata"


def state_dict_metadata(state_dict: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The per-module metadata torch's ``state_dict`` attached to ``state_dict``, or None (a plain dict)."""
    return getattr(state_dict, STATE_DICT_METADATA, None)


def attach_state_dict_metadata(state_dict: Mapping[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """Give ``state_dict`` the metadata attribute torch's state dicts carry; returns ``metadata``."""
    setattr(state_dict, STATE_DICT_METADATA, metadata)
    return metadata


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``tensor`` is a view of (``Tensor._base``), or None when it owns its storage.

    SlowMo finds a flat parameter's learning rate through it; if it moved, that lookup fails at the first
    ``perform_slowmo`` with several learning rates."""
    return tensor._base


__all__ = [
    "STATE_DICT_METADATA",
    "BatchNormBase",
    "IncompatibleKeys",
    "attach_state_dict_metadata",
    "state_dict_metadata",
    "view_base",
]
