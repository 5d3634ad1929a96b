"""Offline consolidation: every rank's :func:`~shardkit.nn.fsdp.state_dict.local_state_dict` plus its
:func:`local_metadata_dict` give back the full state dict, without processes or a model (fairscale's
``local_metadata_dict`` / ``consolidate_shard_weights`` pair, on shardkit's layout).

Example::

    torch.save({"weights": model.local_state_dict(), "meta": model.local_metadata_dict()}, f"shard{rank}.pt")
    # later, anywhere, in one process:
    shards = [torch.load(f"shard{r}.pt") for r in range(world_size)]
    full = FullyShardedDataParallel.consolidate_shard_weights(
        [s["weights"] for s in shards], [s["meta"] for s in shards]
    )
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardkit.nn.fsdp.shard_layout import layout
from shardkit.nn.fsdp.unit_module import UnitModule

FORMAT = "shardkit.fsdp.local_metadata/1"


def local_metadata_dict(fsdp: UnitModule) -> dict[str, Any]:
    """How this rank's :func:`local_state_dict` maps onto the full model: per flat parameter its key, the original
    names, shapes and numels in flat order, the tied names, and which chunk of which group this rank holds.

    Plain Python data (strings, ints, lists), so it can be saved next to the local state dict.
    """
    view = layout(fsdp).require_idle("local_metadata_dict()")
    name_of = {(id(e.flat.shard), e.index): e.key for e in view.params if not e.alias}
    aliases: dict[int, list[list[str]]] = {}
    for e in view.params:
        if e.alias:
            aliases.setdefault(id(e.flat.shard), []).append([e.key, name_of[(id(e.flat.shard), e.index)]])
    units = []
    for unit in view.units:
        flats = {}
        for flat in unit.flats:
            meta = flat.meta
            flats[flat.key] = {
                "names": [name_of[(id(flat.shard), i)] for i in range(len(meta.params))],
                "shapes": [list(info.shape) for info in meta.params],
                "numels": [info.numel for info in meta.params],
                "numel": meta.numel,
                "padding": flat.padding,
                "world_size": meta.world_size,
                "rank": meta.rank,
                "shared": aliases.get(id(flat.shard), []),
            }
        if flats:
            no_broadcast = unit.no_broadcast_optim_state
            units.append({"fsdp_path": unit.path, "params": flats, "no_broadcast_optim_state": no_broadcast})
    return {
        "format": FORMAT,
        "param_metadata": units,
        "buffer_names": [b.key for b in view.buffers],
        "state_dict_keys": view.state_dict_keys(),
    }


def consolidate_shard_weights(
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """The full state dict (unwrapped model's keys) from every rank's local state dict and metadata, in rank order.

    Each flat parameter is rebuilt from the first shard of every chunk index of its own group (so experts sharded
    over one rank come from rank 0, as :meth:`state_dict` gives them there). With ``strict``, a metadata entry
    with no matching shard, or shards disagreeing with their metadata, raise a ``ValueError``; otherwise such
    parameters are left out. Buffers come from rank 0's dict.
    """
    if len(shard_weights) != len(shard_metadata) or not shard_weights:
        raise ValueError(
            f"consolidate_shard_weights needs one local state dict and one metadata dict per rank, got "
            f"{len(shard_weights)} and {len(shard_metadata)}"
        )
    for meta in shard_metadata:
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"consolidate_shard_weights: metadata of format {meta.get('format')!r}, expected {FORMAT!r}: pass "
                "what shardkit's local_metadata_dict() returned (fairscale's shard metadata has another layout)"
            )
    out: dict[str, torch.Tensor] = OrderedDict()
    for unit_meta in shard_metadata[0]["param_metadata"]:
        for key, flat in unit_meta["params"].items():
            try:
                full = _gather_flat(key, flat, shard_weights, shard_metadata)
            except ValueError:
                if strict:
                    raise
                continue  # not strict: the flat parameter's names are left out
            offset = 0
            for name, shape, numel in zip(flat["names"], flat["shapes"], flat["numels"]):
                out[name] = full[offset : offset + numel].view(shape).clone()
                offset += numel
            for alias, primary in flat["shared"]:
                out[alias] = out[primary]
    if with_module_buffers:
        for name in shard_metadata[0]["buffer_names"]:
            if name in shard_weights[0]:
                out[name] = shard_weights[0][name]
            elif strict:
                raise ValueError(
                    f"consolidate_shard_weights: buffer '{name}' is missing from rank 0's local state dict"
                )
    order = {key: i for i, key in enumerate(shard_metadata[0]["state_dict_keys"])}
    return OrderedDict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))


def _gather_flat(
    key: str,
    flat: Mapping[str, Any],
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
) -> torch.Tensor:
    """The padded full flat parameter ``key`` from the ranks' shards; ``ValueError`` when they do not make one."""
    chunks: dict[int, torch.Tensor] = {}
    for weights, meta in zip(shard_weights, shard_metadata):
        mine = next((u["params"][key] for u in meta["param_metadata"] if key in u["params"]), None)
        if mine is None or key not in weights:
            continue
        if mine["world_size"] != flat["world_size"] or mine["numel"] != flat["numel"]:
            raise ValueError(f"consolidate_shard_weights: the ranks' metadata disagree on '{key}'")
        chunks.setdefault(mine["rank"], weights[key])
    missing = [r for r in range(flat["world_size"]) if r not in chunks]
    if missing:
        raise ValueError(f"consolidate_shard_weights: no shard {missing} of '{key}' among the given ranks")
    full = torch.cat([chunks[r].detach().reshape(-1) for r in range(flat["world_size"])])
    if full.numel() != flat["numel"] + flat["padding"]:
        raise ValueError(
            f"consolidate_shard_weights: the shards of '{key}' hold {full.numel()} elements, the metadata "
            f"says {flat['numel'] + flat['padding']}"
        )
    return full
