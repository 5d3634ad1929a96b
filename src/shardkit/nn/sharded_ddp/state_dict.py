"""State-dict keys of a wrapped model without the wrapper's ``module.`` level.

``ShardedDataParallel`` keeps the model in its ``module`` attribute, as torch DDP does, which would put a
``module.`` prefix on every key. Two hooks remove that level on save and restore it on load, so a checkpoint of
the wrapped model and one of the plain model are interchangeable, also when the wrapper sits inside another
module (the hooks work at any prefix). Nested-module metadata (the ``version`` entries some modules use to
upgrade old checkpoints) follows the keys.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

WRAPPED = "module"


def strip_wrapper_level(
    module: Optional[nn.Module], state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post hook: ``<prefix>module.<key>`` becomes ``<prefix><key>`` (order kept)."""
    inner = prefix + WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for key in [k for k in metadata if k == prefix + WRAPPED or k.startswith(inner)]:
        value = metadata.pop(key)
        metadata[prefix[:-1] if key == prefix + WRAPPED else prefix + key[len(inner) :]] = value


class WrapperLevelLoad:
    """The load-side hooks of one wrapper: they add the ``module.`` level on the way in and remove it from the
    names of missing / unexpected keys on the way out. The prefix the wrapper was loaded at is kept here,
    between the two hooks."""

    def __init__(self) -> None:
        self.load_prefix = ""
        """The prefix of the wrapper in the state dict being loaded ("" at the top level)."""

    def add_wrapper_level(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load-state-dict pre hook: ``<prefix><key>`` becomes ``<prefix>module.<key>`` for the wrapped model."""
        inner = prefix + WRAPPED + "."
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        self.load_prefix = prefix
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is None:
            return
        # The loader looks metadata up by each module's own prefix; alias (never remove) the caller's entries.
        for key in [k for k in list(metadata) if k == prefix[:-1] or k.startswith(prefix)]:
            alias = prefix + WRAPPED if key == prefix[:-1] else inner + key[len(prefix) :]
            metadata.setdefault(alias, metadata[key])

    def name_keys_without_wrapper_level(self, module: nn.Module, incompatible_keys: Any) -> None:
        """Load-state-dict post hook: report missing / unexpected keys by the names the caller used."""
        prefix = self.load_prefix
        inner = prefix + WRAPPED + "."
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]


def install(module: nn.Module) -> None:
    """Register the three hooks on the wrapper ``module``."""
    module._register_state_dict_hook(strip_wrapper_level)
    load = WrapperLevelLoad()
    # The private spelling exists in every torch >= 2.0; the public one arrived later.
    module._register_load_state_dict_pre_hook(load.add_wrapper_level, with_module=True)
    module.register_load_state_dict_post_hook(load.name_keys_without_wrapper_level)


def strip_ddp_prefix(state_dict: Mapping[str, Any], expected: set[str]) -> Mapping[str, Any]:
    """Accept a torch DDP checkpoint (every key ``module.``-prefixed) when only the stripped keys fit the model.

    The decision needs the model's own keys because a model may itself have a child called ``module``.
    """
    keys = set(state_dict)
    prefix = WRAPPED + "."
    if not keys or keys & expected or not all(k.startswith(prefix) for k in keys):
        return state_dict
    if not {k[len(prefix) :] for k in keys} <= expected:
        return state_dict
    stripped: dict[str, Any] = OrderedDict(state_dict)
    if getattr(state_dict, "_metadata", None) is not None and isinstance(state_dict, dict):
        # A copy whose metadata (torch's attribute on the state dict) can be rewritten without touching the
        # caller's; the values themselves are shared, not copied.
        stripped = copy.deepcopy(state_dict, memo={id(value): value for value in state_dict.values()})
    strip_wrapper_level(None, stripped, "", None)
    return stripped
