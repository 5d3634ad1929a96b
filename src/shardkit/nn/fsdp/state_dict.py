"""State dicts of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`: full, local, DCP-sharded, optimizer.

Four views of the same parameters; every name is the *unwrapped* model's name (wrappers add no ``module.``):

===========================  ======================================================  ==============================
function                     what it holds                                            cost (per call)
===========================  ======================================================  ==============================
:func:`state_dict`           every parameter in full, FP32, plus buffers              one all-gather per flat param;
                                                                                      the full model on every rank
:func:`local_state_dict`     this rank's flat shards (``<unit>.flat_param_<i>``)       no communication
:func:`sharded_state_dict`   per parameter a row-sharded ``DTensor`` for              one all-gather per flat param
                             :mod:`torch.distributed.checkpoint` (any world size)     to save; one per parameter to
                                                                                      load; peak one flat param
optimizer functions          optimizer state unflattened per original parameter       one all-gather per state tensor
===========================  ======================================================  ==============================

Shards cut across original parameters (see :mod:`~shardkit.nn.fsdp.flat_param`), so the DCP view gathers a
unit's flat parameter once and re-cuts every parameter into ``torch.chunk``-style row blocks, the layout DTensor's
``Shard(0)`` uses. A checkpoint saved at one world size then loads at any other, and into unwrapped models.

Loading validates everything first (keys, shapes, layouts) and agrees across ranks before the first write, so a
bad state dict raises an error naming the key and leaves the model unchanged. Full loads need no communication:
each rank cuts its own shard out of the full values.

Example::

    torch.save(model.state_dict(), "full.pt")             # keys as in the unwrapped model, on every rank
    model.load_state_dict(torch.load("full.pt"))

    dcp.save(sharded_state_dict(model), checkpoint_id=path)   # any world size ...
    target = sharded_state_dict(model)                         # ... loads at any other
    dcp.load(target, checkpoint_id=path)
    load_sharded_state_dict(model, target)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, is_dummy
from shardkit.nn.fsdp.api import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.nn.fsdp.runtime import TrainingState

_LOCAL_META_KEY = "shardkit.fsdp.local"


# ---------------------------------------------------------------------------------------------- layout walk
@dataclass(frozen=True)
class _ParamEntry:
    """One original parameter name: where its values live (``handle.meta.params[index]``)."""

    key: str
    handle: FlatParamHandle
    group: GroupLike
    index: int
    alias: bool


@dataclass(frozen=True)
class _BufferEntry:
    key: str
    module: nn.Module
    attr: str


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _walk(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Pre-order modules with unwrapped names; like ``nn.Module.state_dict`` a shared module appears once per path."""
    yield path, module
    for name, child in module._modules.items():
        if child is None:
            continue
        transparent = isinstance(module, FSDP) and name == "module"
        yield from _walk(child, path if transparent else _join(path, name))


def _units(fsdp: FSDP) -> list[FSDP]:
    seen: dict[int, FSDP] = {}
    for _, m in _walk(fsdp):
        if isinstance(m, FSDP):
            seen.setdefault(id(m), m)
    return list(seen.values())


def _layout(fsdp: FSDP) -> tuple[list[_ParamEntry], list[_BufferEntry], dict[str, dict[str, int]]]:
    """Parameter and persistent-buffer entries in ``state_dict`` order, and each module's version metadata."""
    located: dict[int, list[tuple[str, FlatParamHandle, GroupLike, int, bool]]] = {}
    for unit in _units(fsdp):
        for h in unit._unit.group.handles:
            for i, (module, attr) in enumerate(h.locations):
                located.setdefault(id(module), []).append((attr, h, unit.process_group, i, False))
            for (module, attr), info in zip(h.alias_locations, h.meta.shared):
                located.setdefault(id(module), []).append((attr, h, unit.process_group, info.primary, True))
    params: list[_ParamEntry] = []
    buffers: list[_BufferEntry] = []
    versions: dict[str, dict[str, int]] = {}
    for path, module in _walk(fsdp):
        if isinstance(module, FSDP):
            continue
        versions[path] = {"version": getattr(module, "_version", 1)}
        for attr, h, group, i, alias in located.get(id(module), []):
            params.append(_ParamEntry(_join(path, attr), h, group, i, alias))
        for attr, buf in module._buffers.items():
            if buf is not None and attr not in module._non_persistent_buffers_set:
                buffers.append(_BufferEntry(_join(path, attr), module, attr))
    return params, buffers, versions


def _check_idle(fsdp: FSDP, what: str) -> None:
    for unit in _units(fsdp):
        if unit.training_state != TrainingState.IDLE:
            raise RuntimeError(
                f"{what} was called while unit '{unit._unit.name}' is in state {unit.training_state.name}; call it "
                "between training steps, outside forward, backward and summon_full_params()"
            )


def _buffer_dtypes(fsdp: FSDP) -> dict[str, torch.dtype]:
    """Original dtypes of buffers that mixed precision cast, keyed relative to ``fsdp``."""
    root_unit = fsdp._unit.root
    if root_unit is None:
        return dict(fsdp.buffer_original_dtypes)
    root = root_unit.group.owner
    assert isinstance(root, FSDP)
    prefix = next((p for p, m in _walk(root) if m is fsdp), "")
    cut = len(prefix) + 1 if prefix else 0
    return {k[cut:]: v for k, v in root.buffer_original_dtypes.items() if not prefix or k.startswith(prefix + ".")}


def _buffer_value(entry: _BufferEntry, dtypes: Mapping[str, torch.dtype], device: Optional[torch.device]) -> Any:
    buf = entry.module._buffers[entry.attr]
    assert buf is not None
    return buf.detach().to(device=device or buf.device, dtype=dtypes.get(entry.key, buf.dtype))


# ---------------------------------------------------------------------------------------------- communication
def _gather_flat(handle: FlatParamHandle, group: GroupLike, shard: torch.Tensor, label: str) -> torch.Tensor:
    """All-gather a shard-shaped tensor of ``handle`` into the padded full flat buffer (on the compute device)."""
    full = torch.empty(handle.meta.padded_numel, dtype=shard.dtype, device=handle.compute_device)
    c.all_gather_into_tensor(full, shard.detach().to(full.device), group=group, label=f"fsdp:{label}:{handle.label}")
    return full


def _agree(fsdp: FSDP, error: Optional[str]) -> None:
    """Raise on every rank of ``fsdp``'s group if any rank found ``error``, before anything is written."""
    group = fsdp.process_group
    if not is_dummy(group) and fsdp.world_size > 1:
        flag = torch.tensor(
            [1.0 if error else 0.0],
            device=fsdp._unit.group.handles[0].compute_device if fsdp._unit.group.handles else "cpu",
        )
        c.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, label="fsdp:state_dict:validate")
        if flag.item() > 0 and not error:
            error = "another rank rejected its state dict (see its error); nothing was loaded"
    if error:
        raise ValueError(error)


def _validation_error(
    what: str, expected: Mapping[str, torch.Size], given: Mapping[str, Any], strict: bool
) -> tuple[Optional[str], list[str], list[str]]:
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for key, shape in expected.items():
        value = given.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape != shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            problems.append(f"'{key}' has shape {got}, the model needs {tuple(shape)}")
    if not problems:
        return None, missing, unexpected
    return f"{what}: {'; '.join(problems)}. Nothing was loaded.", missing, unexpected


def _write_shards(entries: list[_ParamEntry], value_of: Mapping[str, torch.Tensor]) -> None:
    """Copy each given parameter's part of this rank's shard (no communication: values are full on every rank)."""
    by_handle: dict[int, tuple[FlatParamHandle, dict[int, torch.Tensor]]] = {}
    for e in entries:
        if e.key in value_of:
            by_handle.setdefault(id(e.handle), (e.handle, {}))[1][e.index] = value_of[e.key]
    with torch.no_grad():
        for handle, values in by_handle.values():
            shard = handle.shard
            for s in handle.meta.shard_slices():
                if s.param_index in values:
                    piece = values[s.param_index].reshape(-1)[s.param_start : s.param_end]
                    shard[s.shard_start : s.shard_start + len(piece)].copy_(piece)


def _reshard_all(fsdp: FSDP) -> None:
    # Full copies kept from a forward without backward would be stale after a load.
    for unit in _units(fsdp):
        unit._unit.group.reshard()


# ---------------------------------------------------------------------------------------------- full
def state_dict(
    fsdp: FSDP, *args: Any, destination: Optional[dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
) -> dict[str, Any]:
    """Full, unflattened state dict: exactly the unwrapped model's keys, FP32 parameters, buffers in their
    original dtypes, on ``state_dict_device`` (default: the parameters' device). Call on every rank.

    Also works when torch's ``state_dict`` recursion reaches a wrapped child of an unwrapped root (``destination``
    and ``prefix`` are honoured). Cost: one all-gather per flat parameter; the full model lands on every rank.
    """
    if args:
        raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
    _check_idle(fsdp, "state_dict()")
    params, buffers, versions = _layout(fsdp)
    device = fsdp.state_dict_device
    full_values: dict[tuple[int, int], torch.Tensor] = {}
    for unit in _units(fsdp):
        for h in unit._unit.group.handles:
            full = _gather_flat(h, unit.process_group, h.shard, "state_dict")
            for i, info in enumerate(h.meta.params):
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                full_values[(id(h), i)] = piece.to(device or h.shard.device, copy=True)
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    metadata = getattr(out, "_metadata", None)
    if metadata is None and destination is None:
        metadata = out._metadata = OrderedDict()  # type: ignore[attr-defined]
    if metadata is not None:
        for path, version in versions.items():
            metadata[_join(prefix.rstrip("."), path) if prefix else path] = version
    dtypes = _buffer_dtypes(fsdp)
    by_module: dict[str, list[tuple[str, Any]]] = {}
    for e in params:
        by_module.setdefault(e.key.rpartition(".")[0], []).append((e.key, full_values[(id(e.handle), e.index)]))
    for b in buffers:
        value = _buffer_value(b, dtypes, device)
        by_module.setdefault(b.key.rpartition(".")[0], []).append((b.key, value))
    for path in versions:  # module order; each module's parameters before its buffers, as torch orders them
        for key, value in by_module.pop(path, []):
            out[prefix + key] = value
    return out


def load_state_dict(fsdp: FSDP, full_state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
    """Load a full state dict (from :func:`state_dict` or the unwrapped model) into the shards and buffers.

    Every rank passes the same full dict. Missing or unexpected keys (with ``strict``) and wrong shapes raise a
    ``ValueError`` naming the keys, on every rank, before anything is written. Returns torch's
    ``_IncompatibleKeys(missing_keys, unexpected_keys)``.
    """
    if assign:
        raise ValueError(
            "load_state_dict(assign=True) is not supported by FullyShardedDataParallel: shards are "
            "copied into, never replaced"
        )
    _check_idle(fsdp, "load_state_dict()")
    params, buffers, _ = _layout(fsdp)
    expected = {e.key: e.handle.meta.params[e.index].shape for e in params}
    expected.update({b.key: b.module._buffers[b.attr].shape for b in buffers})  # type: ignore[union-attr]
    error, missing, unexpected = _validation_error("load_state_dict", expected, full_state_dict, strict)
    _agree(fsdp, error)
    _reshard_all(fsdp)
    _write_shards(params, full_state_dict)
    with torch.no_grad():
        for b in buffers:
            if b.key in full_state_dict:
                b.module._buffers[b.attr].copy_(full_state_dict[b.key])  # type: ignore[union-attr]
    return _IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------------------------- local
def _flat_entries(fsdp: FSDP) -> list[tuple[str, FlatParamHandle, FSDP]]:
    out: list[tuple[str, FlatParamHandle, FSDP]] = []
    seen: set[int] = set()
    for path, unit in _walk(fsdp):
        if not isinstance(unit, FSDP) or id(unit) in seen:
            continue
        seen.add(id(unit))
        out.extend((_join(path, h.name), h, unit) for h in unit._unit.group.handles)
    return out


def local_state_dict(fsdp: FSDP) -> dict[str, Any]:
    """This rank's flat shards (``<unit path>.flat_param_<i>``, padding included) and buffers; no communication.

    Only loads back at the same world size and wrapping (:func:`load_local_state_dict` checks both, from the
    layout recorded in the dict's ``_metadata``). The shard tensors are detached references, like torch's.
    """
    _check_idle(fsdp, "local_state_dict()")
    _, buffers, _ = _layout(fsdp)
    out: dict[str, Any] = OrderedDict()
    layout = {}
    for key, h, _unit in _flat_entries(fsdp):
        out[key] = h.shard.detach()
        layout[key] = {"rank": h.meta.rank, "world_size": h.meta.world_size, "numel": h.meta.numel}
    dtypes = _buffer_dtypes(fsdp)
    for b in buffers:
        out[b.key] = _buffer_value(b, dtypes, None)
    out._metadata = OrderedDict({_LOCAL_META_KEY: layout})  # type: ignore[attr-defined]
    return out


def load_local_state_dict(fsdp: FSDP, local_state: Mapping[str, Any], strict: bool = True) -> Any:
    """Load what :func:`local_state_dict` returned on this rank, at the same world size and wrapping."""
    _check_idle(fsdp, "load_local_state_dict()")
    _, buffers, _ = _layout(fsdp)
    flats = _flat_entries(fsdp)
    expected = {key: h.shard.shape for key, h, _ in flats}
    expected.update({b.key: b.module._buffers[b.attr].shape for b in buffers})  # type: ignore[union-attr]
    saved = (getattr(local_state, "_metadata", None) or {}).get(_LOCAL_META_KEY, {})
    layout_errors = []
    for key, h, _ in flats:
        was = saved.get(key)
        now = {"rank": h.meta.rank, "world_size": h.meta.world_size, "numel": h.meta.numel}
        if was is not None and was != now:
            layout_errors.append(f"'{key}' was saved as {was}, this model has {now}")
    error, missing, unexpected = _validation_error("load_local_state_dict", expected, local_state, strict)
    if layout_errors:
        error = (
            f"load_local_state_dict: {'; '.join(layout_errors)}. A local state dict only loads on the same rank at "
            "the same world size and wrapping; use state_dict() or sharded_state_dict() to change world size. "
            "Nothing was loaded."
        )
    _agree(fsdp, error)
    _reshard_all(fsdp)
    with torch.no_grad():
        for key, h, _ in flats:
            if key in local_state:
                h.shard.copy_(local_state[key])
        for b in buffers:
            if b.key in local_state:
                b.module._buffers[b.attr].copy_(local_state[b.key])  # type: ignore[union-attr]
    return _IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------------------------- DCP sharded
def _row_chunk(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's block of rows in DTensor ``Shard(0)`` layout: ``torch.chunk`` sizes, trailing ranks possibly empty."""
    rows = full.shape[0]
    step = -(-rows // world_size)
    start = min(rank * step, rows)
    return full[start : min(start + step, rows)]


def _mesh(group: GroupLike, device: torch.device, cache: dict[int, Any]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if id(group) not in cache:
        cache[id(group)] = DeviceMesh.from_group(group, device.type)  # type: ignore[arg-type]
    return cache[id(group)]


def _check_one_sharding_group(fsdp: FSDP) -> None:
    odd = sorted(u._unit.name for u in _units(fsdp) if u.world_size != fsdp.world_size)
    if odd:
        raise NotImplementedError(
            f"sharded_state_dict: units {odd} are sharded over a group of another size than the root's "
            f"{fsdp.world_size} ranks; their values may differ per group (e.g. per-rank experts), which one DCP key "
            "cannot hold. Save such models with state_dict() or local_state_dict()."
        )


def sharded_state_dict(fsdp: FSDP) -> dict[str, Any]:
    """Per original parameter a ``DTensor`` (``Shard(0)`` over the unit's group) for torch.distributed.checkpoint.

    Keys are the unwrapped model's; buffers are plain tensors (DCP saves them once). Save with
    ``dcp.save(sharded_state_dict(model), checkpoint_id=...)``; to load, at any world size, pass a fresh
    ``sharded_state_dict(model)`` to ``dcp.load`` and then to :func:`load_sharded_state_dict`. Cost: one
    all-gather per flat parameter; the result holds ``1/world_size`` of every parameter, peak one full flat
    parameter more. Units over a size-one :class:`DummyProcessGroup` give plain full tensors.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _check_idle(fsdp, "sharded_state_dict()")
    _check_one_sharding_group(fsdp)
    params, buffers, _ = _layout(fsdp)
    meshes: dict[int, Any] = {}
    values: dict[tuple[int, int], Any] = {}
    for unit in _units(fsdp):
        group = unit.process_group
        for h in unit._unit.group.handles:
            full = _gather_flat(h, group, h.shard, "sharded_state_dict")
            for i, info in enumerate(h.meta.params):
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                if is_dummy(group):
                    values[(id(h), i)] = piece.clone()
                    continue
                placement = Shard(0) if piece.dim() > 0 else Replicate()
                local = _row_chunk(piece, unit.rank, unit.world_size) if piece.dim() > 0 else piece
                values[(id(h), i)] = DTensor.from_local(
                    local.clone(),
                    _mesh(group, full.device, meshes),
                    [placement],
                    run_check=False,
                    shape=piece.shape,
                    stride=piece.stride(),
                )
    out: dict[str, Any] = OrderedDict((e.key, values[(id(e.handle), e.index)]) for e in params)
    dtypes = _buffer_dtypes(fsdp)
    for b in buffers:
        out[b.key] = _buffer_value(b, dtypes, None).clone()
    return out


def load_sharded_state_dict(fsdp: FSDP, sharded: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a dict shaped like :func:`sharded_state_dict` (filled by ``dcp.load``, any saving world size).

    Plain full tensors are accepted in place of DTensors. Validation and the all-or-nothing guarantee are those of
    :func:`load_state_dict`. Cost: one all-gather per parameter (``DTensor.full_tensor``), peak one parameter.
    """
    _check_idle(fsdp, "load_sharded_state_dict()")
    params, buffers, _ = _layout(fsdp)
    expected = {e.key: e.handle.meta.params[e.index].shape for e in params}
    expected.update({b.key: b.module._buffers[b.attr].shape for b in buffers})  # type: ignore[union-attr]
    error, missing, unexpected = _validation_error("load_sharded_state_dict", expected, sharded, strict)
    _agree(fsdp, error)
    _reshard_all(fsdp)
    for e in params:  # same order on every rank: full_tensor() is a collective
        if e.alias or e.key not in sharded:
            continue
        value = sharded[e.key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        _write_shards([e], {e.key: full})
    with torch.no_grad():
        for b in buffers:
            if b.key in sharded:
                b.module._buffers[b.attr].copy_(sharded[b.key])  # type: ignore[union-attr]
    return _IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------------------------- optimizer
def _is_sharded_state(value: Any, shard: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def _optim_handles(fsdp: FSDP, optim: torch.optim.Optimizer) -> dict[int, int]:
    """id(shard) -> index of the optimizer's param group holding it; raises on foreign parameters."""
    shards = {id(h.shard) for _, h, _ in _flat_entries(fsdp)}
    where = {}
    for gi, group in enumerate(optim.param_groups):
        for p in group["params"]:
            if id(p) not in shards:
                raise ValueError(
                    f"the optimizer's param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a shard "
                    "of this FullyShardedDataParallel model; build the optimizer from model.parameters() after wrapping"
                )
            where[id(p)] = gi
    return where


def gather_full_optim_state_dict(
    fsdp: FSDP, optim: torch.optim.Optimizer, recipient_rank: int = 0
) -> Optional[dict[str, Any]]:
    """The optimizer state of the whole model, unflattened per original parameter, on ``recipient_rank``.

    Shaped like ``optim.state_dict()`` of the *unwrapped* model's optimizer: parameter ids count the original
    parameters group by group, each group in the unwrapped model's parameter order, and every group lists the
    original names under ``param_names`` (torch's convention). Load it into a plain optimizer built with the same
    groups, or back into the wrapped one with :func:`get_shard_from_optim_state_dict`. Tensors are on CPU.
    Call on every rank (one all-gather per sharded state tensor); other ranks get ``None``. Parameters whose
    unit is sharded over its own group (per-rank experts) come from the recipient's own copy.
    """
    _check_idle(fsdp, "gather_full_optim_state_dict()")
    group_of = _optim_handles(fsdp, optim)
    params, _, _ = _layout(fsdp)
    keep = fsdp.rank == recipient_rank
    pieces: dict[tuple[int, int], dict[str, Any]] = {}
    for _, h, unit in _flat_entries(fsdp):
        state = optim.state.get(h.shard, {})
        for key in sorted(state):
            value = state[key]
            if _is_sharded_state(value, h.shard):
                full = _gather_flat(h, unit.process_group, value, "optim_state")
            for i, info in enumerate(h.meta.params):
                if not keep:
                    continue
                if _is_sharded_state(value, h.shard):
                    piece: Any = full[info.offset : info.offset + info.numel].view(info.shape).to("cpu", copy=True)
                else:
                    piece = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                pieces.setdefault((id(h), i), {})[key] = piece
    if not keep:
        return None
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [], "param_names": []}
        for g in optim.param_groups
    ]
    members: list[list[_ParamEntry]] = [[] for _ in groups]
    for e in params:
        if not e.alias and id(e.handle.shard) in group_of:
            members[group_of[id(e.handle.shard)]].append(e)
    state_out: dict[int, dict[str, Any]] = {}
    next_id = 0
    for group, entries in zip(groups, members):
        for e in entries:
            group["params"].append(next_id)
            group["param_names"].append(e.key)
            if (id(e.handle), e.index) in pieces:
                state_out[next_id] = pieces[(id(e.handle), e.index)]
            next_id += 1
    return {"state": state_out, "param_groups": groups}


def _full_osd_by_name(fsdp: FSDP, full_osd: Mapping[str, Any]) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (param group index, state) of a full optimizer state dict, using ``param_names`` when present."""
    owners = [e.key for e in _layout(fsdp)[0] if not e.alias]
    groups = full_osd["param_groups"]
    if not all("param_names" in g for g in groups):
        n_ids = sum(len(g["params"]) for g in groups)
        if len(groups) != 1 or n_ids != len(owners):
            raise ValueError(
                "get_shard_from_optim_state_dict: the optimizer state dict has no 'param_names', so its ids can only "
                f"be matched by position, which needs one param group over all {len(owners)} parameters (it has "
                f"{len(groups)} groups, {n_ids} ids). Build the unwrapped optimizer from model.named_parameters() "
                "so torch records the names, or use gather_full_optim_state_dict()."
            )
        groups = [{**groups[0], "param_names": owners}]
    out = {}
    state = full_osd["state"]
    for gi, g in enumerate(groups):
        for pid, name in zip(g["params"], g["param_names"]):
            out[name] = (gi, state.get(pid, {}))
    unknown = sorted(set(out) - set(owners))
    if unknown:
        raise ValueError(
            f"get_shard_from_optim_state_dict: the optimizer state names parameters {unknown} that this "
            "model does not have"
        )
    return out


def get_shard_from_optim_state_dict(
    fsdp: FSDP, full_osd: Mapping[str, Any], optim: Optional[torch.optim.Optimizer] = None
) -> dict[str, Any]:
    """This rank's part of a full optimizer state dict, for ``optim.load_state_dict`` on the wrapped model.

    Groups keep the full dict's order; inside a group the flat parameters are in ``model.parameters()`` order
    (or in ``optim``'s order when it is given), which is how ``torch.optim.SGD(model.parameters())`` lists them.
    Original parameters without state get zeros. No communication.
    """
    by_name = _full_osd_by_name(fsdp, full_osd)
    entries = [e for e in _layout(fsdp)[0] if not e.alias]
    flats = [h for _, h, _ in _flat_entries(fsdp)]
    if optim is not None:
        order = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
        flats.sort(key=lambda h: order.get(id(h.shard), len(order)))
    names: dict[tuple[int, int], str] = {(id(e.handle), e.index): e.key for e in entries}
    n_groups = len(full_osd["param_groups"])
    members: list[list[tuple[FlatParamHandle, dict[str, Any]]]] = [[] for _ in range(n_groups)]
    for h in flats:
        found = {i: by_name[names[(id(h), i)]] for i in range(len(h.meta.params)) if names.get((id(h), i)) in by_name}
        if not found:
            continue
        group_ids = {gi for gi, _ in found.values()}
        if len(group_ids) > 1:
            raise ValueError(
                f"get_shard_from_optim_state_dict: {sorted(names[(id(h), i)] for i in found)} share one flat parameter "
                f"but sit in param groups {sorted(group_ids)}; wrap them in different units or use "
                "flatten_parameters=False"
            )
        members[group_ids.pop()].append((h, _shard_state(h, {i: s for i, (_, s) in found.items()}, names)))
    state_out: dict[int, dict[str, Any]] = {}
    groups = []
    next_id = 0
    for g, group_members in zip(full_osd["param_groups"], members):
        ids = list(range(next_id, next_id + len(group_members)))
        state_out.update({pid: st for pid, (_, st) in zip(ids, group_members) if st})
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": ids})
        next_id += len(ids)
    return {"state": state_out, "param_groups": groups}


def _shard_state(h: FlatParamHandle, states: dict[int, dict[str, Any]], names: dict[tuple[int, int], str]) -> dict:
    """Flatten the per-parameter states of one flat parameter and cut out this rank's shard."""
    out: dict[str, Any] = {}
    keys = sorted({k for s in states.values() for k in s})
    for key in keys:
        values = {i: s[key] for i, s in states.items() if key in s}
        info_of = h.meta.params
        tensor_like = [
            isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == info_of[i].shape for i, v in values.items()
        ]
        if any(tensor_like):
            if not all(tensor_like):
                bad = [names[(id(h), i)] for (i, _), ok in zip(values.items(), tensor_like) if not ok]
                raise ValueError(f"optimizer state '{key}' of {bad} does not have the parameter's shape")
            dtype = next(iter(values.values())).dtype
            full = torch.zeros(h.meta.padded_numel, dtype=dtype, device=h.shard.device)
            for i, v in values.items():
                full[info_of[i].offset : info_of[i].offset + info_of[i].numel].copy_(v.reshape(-1))
            out[key] = h.meta.local_shard(full).clone()
        else:
            first = next(iter(values.values()))
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out
