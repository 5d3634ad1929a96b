"""Full state dicts (every parameter unflattened, original keys) and local ones (this rank's flat shards)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.groups import is_dummy
from shardkit.nn._torch_private import IncompatibleKeys, attach_state_dict_metadata, state_dict_metadata
from shardkit.nn.fsdp.shard_layout import FlatLayout, join_name, layout, reshard
from shardkit.nn.fsdp.state_dict._io import (
    agree,
    gathered_params,
    load_buffers,
    validation_error,
    write_shards,
)
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules

_LOCAL_META_KEY = "shardkit.fsdp.local"
_STATE_DICT_ARGS = ("destination", "prefix", "keep_vars")


def state_dict_arguments(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any], positional: bool = True
) -> dict[str, Any]:
    """``nn.Module.state_dict``'s arguments as a keyword dict: by keyword, or (``positional``) also in its order."""
    if args and not positional:
        raise TypeError(f"{method}() takes keyword arguments only (destination=, prefix=, keep_vars=)")
    unknown = sorted(set(kwargs) - set(_STATE_DICT_ARGS))
    if unknown or len(args) > len(_STATE_DICT_ARGS):
        got = f"unexpected keyword arguments {unknown}" if unknown else f"{len(args)} positional arguments"
        raise TypeError(f"{method}() got {got}; it takes nn.Module.state_dict's destination, prefix, keep_vars")
    given = dict(zip(_STATE_DICT_ARGS, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"{method}() got {twice} both by position and by keyword; pass each once")
    return {**given, **kwargs}


def state_dict(
    fsdp: UnitModule, destination: Optional[dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
) -> dict[str, Any]:
    """Full, unflattened state dict: exactly the unwrapped model's keys, FP32 parameters, buffers in their
    original dtypes, on ``state_dict_device`` (default: the parameters' device). Call on every rank.

    Also works when torch's ``state_dict`` recursion reaches a wrapped child of an unwrapped root (``destination``
    and ``prefix`` are honoured). Cost: one all-gather per flat parameter; the full model lands on every rank,
    except with ``state_dict_on_rank_0_only``: every rank still takes part in the gathers, but only global rank 0
    copies the values out and the others get ``{}`` (nothing added to ``destination``).
    """
    view = layout(fsdp).require_idle("state_dict()")
    device = fsdp.state_dict_device
    keep = not fsdp.state_dict_on_rank_0_only or _global_rank(fsdp) == 0
    values = gathered_params(
        view, "state_dict", lambda _, flat, value: value.to(device or flat.shard.device, copy=True) if keep else None
    )
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    if not keep:
        return out
    metadata = state_dict_metadata(out)
    if metadata is None and destination is None:
        metadata = attach_state_dict_metadata(out, OrderedDict())
    if metadata is not None:
        for path, version in view.module_versions:
            metadata[join_name(prefix.rstrip("."), path) if prefix else path] = {"version": version}
    values.update((b.key, b.value(device)) for b in view.buffers)
    for key in view.state_dict_keys():  # module order; each module's parameters before its buffers, as torch's
        out[prefix + key] = values[key]
    return out


def _global_rank(fsdp: UnitModule) -> int:
    """fairscale's "rank 0" for ``state_dict_on_rank_0_only``: the global rank (the group's rank without
    ``torch.distributed``, e.g. under a ``DummyProcessGroup``)."""
    if dist.is_available() and dist.is_initialized() and not is_dummy(fsdp.process_group):
        return dist.get_rank()
    return fsdp.rank


def load_state_dict(
    fsdp: UnitModule, full_state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> IncompatibleKeys:
    """Load a full state dict (from :func:`state_dict` or the unwrapped model) into the shards and buffers.

    Every rank passes the same full dict. Missing or unexpected keys (with ``strict``) and wrong shapes raise a
    ``ValueError`` naming the keys, on every rank, before anything is written. Returns torch's
    ``IncompatibleKeys(missing_keys, unexpected_keys)``.
    """
    if assign:
        raise ValueError(
            "load_state_dict(assign=True) is not supported by FullyShardedDataParallel: shards are "
            "copied into, never replaced"
        )
    view = layout(fsdp).require_idle("load_state_dict()")
    error, missing, unexpected = validation_error("load_state_dict", view.expected_shapes(), full_state_dict, strict)
    agree(fsdp, view, error)
    reshard(fsdp)
    write_shards(list(view.params), full_state_dict)
    load_buffers(view, full_state_dict)
    return IncompatibleKeys(missing, unexpected)


def load_from_state_dict_hook(
    fsdp: UnitModule,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``FullyShardedDataParallel._load_from_state_dict``: load full keys when torch's recursion reaches a wrapped
    child of an *unwrapped* root (``plain_model.load_state_dict(sd)`` after ``auto_wrap``).

    Loads this unit's own parameters into its shards, then re-files the keys of buffers and nested units under
    the module paths torch's recursion visits next (``<prefix>module.<name>``), so each finds its values. Errors
    follow torch's protocol (collected, raised by ``load_state_dict`` at the end), so unlike
    :func:`load_state_dict` other modules may already be loaded when a bad key is reported, and a unit nested in
    another unit names its keys by the path torch visits (``body.module.0.weight`` for ``body.0.weight``).
    """
    view = layout(fsdp).require_idle("load_state_dict()")
    own = {id(flat.shard) for flat in view.units[0].flats}
    params = [e for e in view.params if id(e.flat.shard) in own]
    refile: dict[str, str] = {}  # clean key -> the key torch's recursion will look up, both relative to prefix
    # Below fsdp, not descending into nested units (they re-file their own keys).
    for clean, real, module in walk_modules(fsdp, once=False, into_units=False):
        if module is fsdp:
            continue
        if isinstance(module, UnitModule):
            nested = layout(module)
            for key in [e.key for e in nested.params] + [b.key for b in nested.buffers]:
                refile[join_name(clean, key)] = join_name(real, key)
        else:
            for attr, buf in module._buffers.items():
                if buf is not None and attr not in module._non_persistent_buffers_set:
                    refile[join_name(clean, attr)] = join_name(real, attr)
    known = {e.key for e in params} | set(refile) | set(refile.values())
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key[len(prefix) :] not in known:
            unexpected_keys.append(key)
    values = {}
    for e in params:
        value, shape = state_dict.get(prefix + e.key), e.shape
        if value is None:
            missing_keys.append(prefix + e.key)
        elif not isinstance(value, torch.Tensor) or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            error_msgs.append(f"'{prefix + e.key}' has shape {got}, the model needs {tuple(shape)}")
        else:
            values[e.key] = value
    reshard(fsdp, recurse=False)
    write_shards(params, values)
    for clean, real in refile.items():
        if prefix + clean in state_dict:
            state_dict[prefix + real] = state_dict[prefix + clean]


# ---------------------------------------------------------------------------------------------- local
def local_state_dict(
    fsdp: UnitModule, destination: Optional[dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
) -> dict[str, Any]:
    """This rank's flat shards (``<unit path>.flat_param_<i>``, padding included) and buffers; no communication.

    Only loads back at the same world size and wrapping (:func:`load_local_state_dict` checks both, from the
    layout recorded in the dict's ``_metadata``). The shard tensors are detached references, like torch's, or the
    parameters themselves with ``keep_vars``. ``destination`` and ``prefix`` work as in ``nn.Module.state_dict``
    (the layout is recorded under the prefixed keys, so strip the prefix before loading back).
    """
    view = layout(fsdp).require_idle("local_state_dict()")
    if not isinstance(prefix, str):
        raise TypeError(f"local_state_dict(prefix=...) takes a string such as 'model.', got {type(prefix).__name__}")
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    saved_layout = {}
    for flat in view.flats:
        out[prefix + flat.key] = flat.shard if keep_vars else flat.shard.detach()
        saved_layout[prefix + flat.key] = _saved_as(flat)
    for b in view.buffers:
        out[prefix + b.key] = b.value()
    metadata = state_dict_metadata(out)
    if metadata is not None:
        metadata.setdefault(_LOCAL_META_KEY, {}).update(saved_layout)
    elif destination is None or hasattr(destination, "__dict__"):  # a plain dict takes no attribute (torch skips it)
        attach_state_dict_metadata(out, OrderedDict({_LOCAL_META_KEY: saved_layout}))
    return out


def load_local_state_dict(fsdp: UnitModule, local_state: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Load what :func:`local_state_dict` returned on this rank, at the same world size and wrapping."""
    view = layout(fsdp).require_idle("load_local_state_dict()")
    expected = {flat.key: flat.shard.shape for flat in view.flats}
    expected.update((b.key, b.tensor.shape) for b in view.buffers)
    saved = (state_dict_metadata(local_state) or {}).get(_LOCAL_META_KEY, {})
    layout_errors = []
    for flat in view.flats:
        was, now = saved.get(flat.key), _saved_as(flat)
        if was is not None and was != now:
            layout_errors.append(f"'{flat.key}' was saved as {was}, this model has {now}")
    error, missing, unexpected = validation_error("load_local_state_dict", expected, local_state, strict)
    if layout_errors:
        error = (
            f"load_local_state_dict: {'; '.join(layout_errors)}. A local state dict only loads on the same rank at "
            "the same world size and wrapping; use state_dict() or sharded_state_dict() to change world size. "
            "Nothing was loaded."
        )
    agree(fsdp, view, error)
    reshard(fsdp)
    with torch.no_grad():
        for flat in view.flats:
            if flat.key in local_state:
                flat.shard.copy_(local_state[flat.key])
    load_buffers(view, local_state)
    return IncompatibleKeys(missing, unexpected)


def _saved_as(flat: FlatLayout) -> dict[str, int]:
    """What a local state dict records of a shard, and what a load checks against."""
    return {"rank": flat.meta.rank, "world_size": flat.meta.world_size, "numel": flat.meta.numel}
