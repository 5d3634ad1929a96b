"""Full state dicts (every parameter unflattened, original keys) and local ones (this rank's flat shards)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.groups import is_dummy
from shardkit.nn._torch_private import IncompatibleKeys, attach_state_dict_metadata, state_dict_metadata
from shardkit.nn.fsdp.state_dict._layout import (
    agree,
    buffer_dtypes,
    buffer_value,
    check_idle,
    expected_shapes,
    flat_entries,
    gather_flat,
    join,
    layout,
    reshard_all,
    units,
    validation_error,
    write_shards,
)
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules

_LOCAL_META_KEY = "shardkit.fsdp.local"


def state_dict(
    fsdp: UnitModule,
    *args: Any,
    destination: Optional[dict[str, Any]] = None,
    prefix: str = "",
    keep_vars: bool = False,
) -> dict[str, Any]:
    """Full, unflattened state dict: exactly the unwrapped model's keys, FP32 parameters, buffers in their
    original dtypes, on ``state_dict_device`` (default: the parameters' device). Call on every rank.

    Also works when torch's ``state_dict`` recursion reaches a wrapped child of an unwrapped root (``destination``
    and ``prefix`` are honoured). Cost: one all-gather per flat parameter; the full model lands on every rank,
    except with ``state_dict_on_rank_0_only``: every rank still takes part in the gathers, but only global rank 0
    copies the values out and the others get ``{}`` (nothing added to ``destination``).
    """
    if args:
        raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
    check_idle(fsdp, "state_dict()")
    params, buffers, versions = layout(fsdp)
    device = fsdp.state_dict_device
    keep = not fsdp.state_dict_on_rank_0_only or _global_rank(fsdp) == 0
    full_values: dict[tuple[int, int], torch.Tensor] = {}
    for unit in units(fsdp):
        for h in unit.fsdp_unit.group.handles:
            full = gather_flat(h, unit.process_group, h.shard, "state_dict")
            if not keep:
                continue
            for i, info in enumerate(h.meta.params):
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                full_values[(id(h), i)] = piece.to(device or h.shard.device, copy=True)
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    if not keep:
        return out
    metadata = state_dict_metadata(out)
    if metadata is None and destination is None:
        metadata = attach_state_dict_metadata(out, OrderedDict())
    if metadata is not None:
        for path, version in versions.items():
            metadata[join(prefix.rstrip("."), path) if prefix else path] = version
    dtypes = buffer_dtypes(fsdp)
    by_module: dict[str, list[tuple[str, Any]]] = {}
    for e in params:
        by_module.setdefault(e.key.rpartition(".")[0], []).append((e.key, full_values[(id(e.handle), e.index)]))
    for b in buffers:
        value = buffer_value(b, dtypes, device)
        by_module.setdefault(b.key.rpartition(".")[0], []).append((b.key, value))
    for path in versions:  # module order; each module's parameters before its buffers, as torch orders them
        for key, value in by_module.pop(path, []):
            out[prefix + key] = value
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
    check_idle(fsdp, "load_state_dict()")
    params, buffers, _ = layout(fsdp)
    expected = expected_shapes(params, buffers)
    error, missing, unexpected = validation_error("load_state_dict", expected, full_state_dict, strict)
    agree(fsdp, error)
    reshard_all(fsdp)
    write_shards(params, full_state_dict)
    with torch.no_grad():
        for b in buffers:
            if b.key in full_state_dict:
                b.module._buffers[b.attr].copy_(full_state_dict[b.key])  # type: ignore[union-attr]
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
    check_idle(fsdp, "load_state_dict()")
    own = {id(h) for h in fsdp.fsdp_unit.group.handles}
    params = [e for e in layout(fsdp)[0] if id(e.handle) in own]
    refile: dict[str, str] = {}  # clean key -> the key torch's recursion will look up, both relative to prefix
    for real, clean, module in _walk_real(fsdp):
        if isinstance(module, UnitModule):
            nested_params, nested_buffers, _ = layout(module)
            for key in [e.key for e in nested_params] + [b.key for b in nested_buffers]:
                refile[join(clean, key)] = join(real, key)
        else:
            for attr, buf in module._buffers.items():
                if buf is not None and attr not in module._non_persistent_buffers_set:
                    refile[join(clean, attr)] = join(real, attr)
    known = {e.key for e in params} | set(refile) | set(refile.values())
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key[len(prefix) :] not in known:
            unexpected_keys.append(key)
    values = {}
    for e in params:
        value, shape = state_dict.get(prefix + e.key), e.handle.meta.params[e.index].shape
        if value is None:
            missing_keys.append(prefix + e.key)
        elif not isinstance(value, torch.Tensor) or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            error_msgs.append(f"'{prefix + e.key}' has shape {got}, the model needs {tuple(shape)}")
        else:
            values[e.key] = value
    fsdp.fsdp_unit.group.reshard()
    write_shards(params, values)
    for clean, real in refile.items():
        if prefix + clean in state_dict:
            state_dict[prefix + real] = state_dict[prefix + clean]


def _walk_real(fsdp: UnitModule) -> Iterator[tuple[str, str, nn.Module]]:
    """``(real path, clean path, module)`` below ``fsdp``, not descending into nested units (they re-file their own)."""
    for clean, real, module in walk_modules(fsdp, once=False, into_units=False):
        if module is not fsdp:
            yield real, clean, module


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
    check_idle(fsdp, "local_state_dict()")
    if not isinstance(prefix, str):
        raise TypeError(f"local_state_dict(prefix=...) takes a string such as 'model.', got {type(prefix).__name__}")
    _, buffers, _ = layout(fsdp)
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    saved_layout = {}
    for key, h, _unit in flat_entries(fsdp):
        out[prefix + key] = h.shard if keep_vars else h.shard.detach()
        saved_layout[prefix + key] = {"rank": h.meta.rank, "world_size": h.meta.world_size, "numel": h.meta.numel}
    dtypes = buffer_dtypes(fsdp)
    for b in buffers:
        out[prefix + b.key] = buffer_value(b, dtypes, None)
    metadata = state_dict_metadata(out)
    if metadata is not None:
        metadata.setdefault(_LOCAL_META_KEY, {}).update(saved_layout)
    elif destination is None or hasattr(destination, "__dict__"):  # a plain dict takes no attribute (torch skips it)
        attach_state_dict_metadata(out, OrderedDict({_LOCAL_META_KEY: saved_layout}))
    return out


def load_local_state_dict(fsdp: UnitModule, local_state: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Load what :func:`local_state_dict` returned on this rank, at the same world size and wrapping."""
    check_idle(fsdp, "load_local_state_dict()")
    _, buffers, _ = layout(fsdp)
    flats = flat_entries(fsdp)
    expected = {key: h.shard.shape for key, h, _ in flats}
    expected.update(expected_shapes([], buffers))
    saved = (state_dict_metadata(local_state) or {}).get(_LOCAL_META_KEY, {})
    layout_errors = []
    for key, h, _ in flats:
        was = saved.get(key)
        now = {"rank": h.meta.rank, "world_size": h.meta.world_size, "numel": h.meta.numel}
        if was is not None and was != now:
            layout_errors.append(f"'{key}' was saved as {was}, this model has {now}")
    error, missing, unexpected = validation_error("load_local_state_dict", expected, local_state, strict)
    if layout_errors:
        error = (
            f"load_local_state_dict: {'; '.join(layout_errors)}. A local state dict only loads on the same rank at "
            "the same world size and wrapping; use state_dict() or sharded_state_dict() to change world size. "
            "Nothing was loaded."
        )
    agree(fsdp, error)
    reshard_all(fsdp)
    with torch.no_grad():
        for key, h, _ in flats:
            if key in local_state:
                h.shard.copy_(local_state[key])
        for b in buffers:
            if b.key in local_state:
                b.module._buffers[b.attr].copy_(local_state[b.key])  # type: ignore[union-attr]
    return IncompatibleKeys(missing, unexpected)
