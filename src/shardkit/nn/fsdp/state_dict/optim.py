"""Optimizer state: gathered into the unwrapped model's layout, and cut back into this rank's flat shards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from shardkit.distributed.groups import GroupLike
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.shard_layout import FlatLayout, ParamName, ShardLayout, layout
from shardkit.nn.fsdp.state_dict._io import gather_flat
from shardkit.nn.fsdp.unit_module import UnitModule


def _shaped_like(value: Any, shape: torch.Size) -> bool:
    """True for per-element optimizer state (a tensor of ``shape``: a shard's, or a parameter's), not a step count."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def _cpu_copy(value: Any) -> Any:
    """A CPU copy of a tensor (every piece gets its own, so none is shared by two parameters); else ``value``."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _optim_groups(view: ShardLayout, optim: Any) -> dict[int, int]:
    """id(shard) -> index of the optimizer's param group holding it; raises on foreign parameters."""
    shards = {id(flat.shard) for flat in view.flats}
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


def optim_input_error(optim: Any) -> Optional[str]:
    """Why ``optim`` cannot be read by :func:`gather_full_optim_state_dict` (None when it can): a torch optimizer
    or a wrapper with ``param_groups`` and a ``state`` mapping or ``state_dict()`` (training frameworks pass their
    own optimizer classes; fairscale only asks them for those)."""
    if not isinstance(getattr(optim, "param_groups", None), list):
        return (
            "gather_full_optim_state_dict needs the optimizer stepping this model's parameters (a torch optimizer, "
            f"or an object with 'param_groups' and 'state_dict()'), got {type(optim).__name__} without a "
            "'param_groups' list; pass the optimizer built from model.parameters() after wrapping"
        )
    if not isinstance(getattr(optim, "state", None), Mapping) and not callable(getattr(optim, "state_dict", None)):
        return (
            f"gather_full_optim_state_dict: {type(optim).__name__} has neither a 'state' mapping nor 'state_dict()'; "
            "pass the torch optimizer it wraps"
        )
    return None


def every_rank_checks_optim(group: GroupLike, optim: Any) -> None:
    """Return once every rank of ``group`` called ``gather_full_optim_state_dict()`` with an ``optim`` it can read;
    else raise on every rank (:func:`~shardkit.nn.fsdp.collective_calls.every_rank_calls`)."""
    local_error = optim_input_error(optim)
    call = "gather_full_optim_state_dict()"
    # A rank refusing its input says so in the call name, so the others raise too instead of waiting.
    every_rank_calls(group, call if local_error is None else f"{call} refused: {local_error}")
    if local_error is not None:
        raise TypeError(local_error)


def _state_by_param(optim: Any) -> dict[int, dict[str, Any]]:
    """id(parameter) -> its optimizer state (see :func:`optim_input_error` for what ``optim`` may be)."""
    state = getattr(optim, "state", None)
    if isinstance(state, Mapping):
        return {id(p): s for p, s in state.items()}
    saved = optim.state_dict()
    params = [p for g in optim.param_groups for p in g["params"]]
    ids = [pid for g in saved["param_groups"] for pid in g["params"]]
    if len(ids) != len(params):
        raise ValueError(
            f"gather_full_optim_state_dict: {type(optim).__name__}.state_dict() lists {len(ids)} parameters but its "
            f"param_groups hold {len(params)}; pass the torch optimizer it wraps"
        )
    return {id(p): saved["state"].get(pid, {}) for p, pid in zip(params, ids)}


def gather_full_optim_state_dict(fsdp: UnitModule, optim: Any, recipient_rank: int = 0) -> Optional[dict[str, Any]]:
    """The optimizer state of the whole model, unflattened per original parameter, on ``recipient_rank``.

    Shaped like ``optim.state_dict()`` of the *unwrapped* model's optimizer: parameter ids count the original
    parameters group by group, each group in the unwrapped model's parameter order, and every group lists the
    original names under ``param_names`` (torch's convention). ``optim`` is a torch optimizer or a wrapper with
    ``param_groups`` and ``state_dict()`` (fairscale only calls those). Load it into a plain optimizer built with the
    same groups, or back into the wrapped one with :func:`get_shard_from_optim_state_dict`. Tensors are on CPU.
    Call on every rank (one all-gather per sharded state tensor); other ranks get ``None``. Parameters whose
    unit is sharded over its own group (per-rank experts) come from the recipient's own copy. Units built with
    ``no_broadcast_optim_state=True`` and sharded over several ranks are not gathered: their parameters get no
    state, and their ids are listed under ``uncollected_local_ids`` (fairscale's key) for the caller to fill in.
    """
    view = layout(fsdp).require_idle("gather_full_optim_state_dict()")
    state_of = _state_by_param(optim)
    group_of = _optim_groups(view, optim)
    keep = fsdp.rank == recipient_rank
    pieces: dict[tuple[int, int], dict[str, Any]] = {}
    uncollected: set[int] = set()
    for unit in view.units:
        for flat in unit.flats:
            if unit.no_broadcast_optim_state and unit.world_size > 1:
                uncollected.add(id(flat.shard))
                continue
            state = state_of.get(id(flat.shard), {})
            for key in sorted(state):
                value = state[key]
                # Sharded state is gathered on every rank; anything else (a step count) is the same for each piece.
                if _shaped_like(value, flat.shard.shape):
                    values = flat.meta.views(gather_flat(flat, value, "optim_state"))
                else:
                    values = [value] * len(flat.meta.params)
                for i, piece in enumerate(values if keep else []):
                    pieces.setdefault((id(flat.shard), i), {})[key] = _cpu_copy(piece)
    if not keep:
        return None
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [], "param_names": []}
        for g in optim.param_groups
    ]
    members: list[list[ParamName]] = [[] for _ in groups]
    for e in view.params:
        if not e.alias and id(e.flat.shard) in group_of:
            members[group_of[id(e.flat.shard)]].append(e)
    state_out: dict[int, dict[str, Any]] = {}
    uncollected_ids = []
    next_id = 0
    for group, entries in zip(groups, members):
        for e in entries:
            group["params"].append(next_id)
            group["param_names"].append(e.key)
            if (id(e.flat.shard), e.index) in pieces:
                state_out[next_id] = pieces[(id(e.flat.shard), e.index)]
            if id(e.flat.shard) in uncollected:
                uncollected_ids.append(next_id)
            next_id += 1
    return {"state": state_out, "param_groups": groups, "uncollected_local_ids": uncollected_ids}


def _full_osd_by_name(view: ShardLayout, full_osd: Mapping[str, Any]) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (param group index, state) of a full optimizer state dict, using ``param_names`` when present."""
    owners = [e.key for e in view.params if not e.alias]
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
    fsdp: UnitModule, full_osd: Mapping[str, Any], optim: Optional[torch.optim.Optimizer] = None
) -> dict[str, Any]:
    """This rank's part of a full optimizer state dict, for ``optim.load_state_dict`` on the wrapped model.

    Groups keep the full dict's order; inside a group the flat parameters are in ``model.parameters()`` order
    (or in ``optim``'s order when it is given), which is how ``torch.optim.SGD(model.parameters())`` lists them.
    Original parameters without state get zeros. No communication.
    """
    view = layout(fsdp)
    by_name = _full_osd_by_name(view, full_osd)
    flats = list(view.flats)
    if optim is not None:
        order = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
        flats.sort(key=lambda f: order.get(id(f.shard), len(order)))
    names: dict[int, dict[int, str]] = {}  # id(shard) -> index in the flat parameter -> the stored name
    for e in view.params:
        if not e.alias:
            names.setdefault(id(e.flat.shard), {})[e.index] = e.key
    n_groups = len(full_osd["param_groups"])
    members: list[list[tuple[FlatLayout, dict[str, Any]]]] = [[] for _ in range(n_groups)]
    for flat in flats:
        named = names.get(id(flat.shard), {})
        found = {i: by_name[named[i]] for i in sorted(named) if named[i] in by_name}
        if not found:
            continue
        group_ids = {gi for gi, _ in found.values()}
        if len(group_ids) > 1:
            raise ValueError(
                f"get_shard_from_optim_state_dict: {sorted(named[i] for i in found)} share one flat parameter "
                f"but sit in param groups {sorted(group_ids)}; wrap them in different units or use "
                "flatten_parameters=False"
            )
        members[group_ids.pop()].append((flat, _shard_state(flat, {i: s for i, (_, s) in found.items()}, named)))
    state_out: dict[int, dict[str, Any]] = {}
    groups = []
    next_id = 0
    for g, group_members in zip(full_osd["param_groups"], members):
        ids = list(range(next_id, next_id + len(group_members)))
        state_out.update({pid: st for pid, (_, st) in zip(ids, group_members) if st})
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": ids})
        next_id += len(ids)
    return {"state": state_out, "param_groups": groups}


def _shard_state(h: FlatLayout, states: dict[int, dict[str, Any]], names: dict[int, str]) -> dict:
    """Flatten the per-parameter states of one flat parameter and cut out this rank's shard."""
    out: dict[str, Any] = {}
    keys = sorted({k for s in states.values() for k in s})
    for key in keys:
        values = {i: s[key] for i, s in states.items() if key in s}
        info_of = h.meta.params
        tensor_like = [_shaped_like(v, info_of[i].shape) for i, v in values.items()]
        if any(tensor_like):
            if not all(tensor_like):
                bad = [names[i] for (i, _), ok in zip(values.items(), tensor_like) if not ok]
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
