"""State-dict keys of a wrapped model: fairscale's and torch DDP's ``module.`` level on save, both forms on load.

``ShardedDataParallel`` keeps the model in its ``module`` attribute, as torch DDP and fairscale's ShardedDDP do,
so its state dict keys carry a ``module.`` prefix (``module.fc.weight``) and a checkpoint moves strictly between
the three wrappers. Loading also takes the plain model's keys (``fc.weight``): a load pre-hook adds the level
when the keys fit the wrapped model only without it. The hook works at any prefix, so the same holds when the
wrapper sits inside another module whose ``load_state_dict`` recurses into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from shardkit.nn._torch_private import state_dict_metadata

WRAPPED = "module"


def _needs_wrapper_level(keys: set[str], inner_keys: set[str]) -> bool:
    """True when ``keys`` (relative to the wrapper) are the plain model's rather than the wrapper's.

    Decided by fit, not by spelling, because a model may itself have a child called ``module``.
    """
    wrapper_keys = {f"{WRAPPED}.{k}" for k in inner_keys}
    return bool(keys & inner_keys) and not keys & wrapper_keys


def add_wrapper_level_hook(inner_keys: Callable[[], set[str]]) -> Callable[..., None]:
    """A load-state-dict pre hook: ``<prefix><key>`` becomes ``<prefix>module.<key>`` when the keys under the
    wrapper's prefix are the plain model's (``inner_keys()`` lists those)."""

    def add_wrapper_level(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        under = [k for k in state_dict if k.startswith(prefix)]
        if not _needs_wrapper_level({k[len(prefix) :] for k in under}, inner_keys()):
            return
        inner = prefix + WRAPPED + "."
        for key in under:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        metadata = state_dict_metadata(state_dict)
        if metadata is None:
            return
        # The loader looks metadata up by each module's own prefix; alias (never remove) the caller's entries.
        for key in [k for k in list(metadata) if k == prefix[:-1] or k.startswith(prefix)]:
            alias = prefix + WRAPPED if key == prefix[:-1] else inner + key[len(prefix) :]
            metadata.setdefault(alias, metadata[key])

    return add_wrapper_level


def install(wrapper: nn.Module) -> None:
    """Register the load hook on ``wrapper``, whose wrapped model is its child ``module``."""

    def inner_keys() -> set[str]:
        wrapped: Any = wrapper._modules[WRAPPED]
        return set(wrapped.state_dict().keys())

    wrapper._register_load_state_dict_pre_hook(add_wrapper_level_hook(inner_keys))


def load_explained(load: Callable[..., Any], state_dict: Any, strict: bool, assign: bool) -> Any:
    """``load(state_dict, strict, assign)`` whose mismatch error also says which key forms the wrapper takes."""
    try:
        return load(state_dict, strict=strict, assign=assign)
    except RuntimeError as error:
        if "state_dict" not in str(error):
            raise
        raise RuntimeError(
            f"{error}\nShardedDataParallel.load_state_dict takes the keys its state_dict() returns ('module.<name>', "
            "as fairscale's ShardedDDP and torch DDP save them) or the wrapped model's own ('<name>', from "
            "model.state_dict() of the unwrapped model); load a checkpoint of another model with strict=False"
        ) from error
