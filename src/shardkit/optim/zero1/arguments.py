"""OSS's keyword arguments: its own, and those it passes on to the optimizer class it wraps.

``OSS(params, optim=torch.optim.SGD, lr=0.1, brodcast_fp16=True)`` would otherwise fail inside the wrapped class
(``SGD.__init__() got an unexpected keyword argument``), naming neither OSS nor the argument it meant.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any, Callable

from shardkit.utils.tensors import is_fsdp_shard

#: OSS's own arguments (fairscale's names); every other keyword goes to the wrapped optimizer class.
OSS_ARGUMENTS = ("params", "optim", "group", "broadcast_buffer_size", "broadcast_fp16", "force_broadcast_object")


def _accepted(optim: Callable[..., Any]) -> list[str] | None:
    """The keywords ``optim`` takes besides its parameters, or None when it cannot tell (``**kwargs``, builtins)."""
    try:
        signature = inspect.signature(optim)
    except (TypeError, ValueError):
        return None
    names = []
    for name, parameter in signature.parameters.items():
        if parameter.kind == inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.append(name)
    return [name for name in names if name not in ("self", "params")]


def check_optimizer_arguments(optim: Callable[..., Any], defaults: dict[str, Any]) -> None:
    """Raise a ``TypeError`` naming OSS and the allowed arguments for a keyword neither OSS nor ``optim`` takes.

    Example::

        check_optimizer_arguments(torch.optim.SGD, {"lr": 0.1, "brodcast_fp16": True})   # TypeError: did you mean
    """
    accepted = _accepted(optim)
    if accepted is None:
        return
    unknown = [key for key in defaults if key not in accepted]
    if not unknown:
        return
    name = getattr(optim, "__name__", type(optim).__name__)
    close = difflib.get_close_matches(unknown[0], [*OSS_ARGUMENTS, *accepted], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(
        f"OSS got unexpected keyword argument(s) {unknown}{hint}. OSS's own arguments are {', '.join(OSS_ARGUMENTS)}; "
        f"every other keyword goes to the optimizer class optim={name}, which takes {', '.join(accepted)}."
    )


def refuse_fsdp_shards(param_groups: Sequence[dict[str, Any]]) -> None:
    """Raise a ``ValueError`` if any parameter is a FullyShardedDataParallel flat shard.

    ``OSS(fsdp_model.parameters(), ...)`` (OSS under FSDP, or FSDP inside ShardedDataParallel) trains a wrong model
    without a word: each rank's shards hold different slices of the model, and OSS would give each shard one
    owner that steps it and broadcasts its values over the other ranks' different slices.
    """
    shards = [p for group in param_groups for p in group["params"] if is_fsdp_shard(p)]
    if shards:
        raise ValueError(
            f"OSS was given {len(shards)} parameter(s) that are FullyShardedDataParallel's flat shards (OSS under "
            "FSDP, or FSDP inside ShardedDataParallel). FSDP already shards parameters, gradients and optimizer "
            "state: OSS would give each rank's shard one owner and broadcast its values over the other ranks' "
            "different shards, training a wrong model. Use one strategy: a plain optimizer over the FSDP model "
            "(`optimizer = torch.optim.AdamW(fsdp_model.parameters(), ...)`), or OSS and ShardedDataParallel over "
            "the unwrapped model."
        )
