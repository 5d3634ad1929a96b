"""Which elements of which original parameter an FSDP flat shard holds: the pure arithmetic of the FSDP source.

A flat parameter concatenates a unit's parameters and pads the result to a multiple of the unit's group size;
rank ``r`` of the group keeps chunk ``r``. :meth:`FlatParamMeta.shard_slices` already says which part of each
parameter falls into this rank's chunk; here that becomes one :class:`FlatPiece` per parameter, named as the
unwrapped model names it (the unit's clean path, then the name inside the unit). No communication, no model:
unit tests check these against real shards at every world size.

Example::

    pieces = flat_param_pieces("blocks.0", meta)   # meta = unit.flat_param_metas[0]
    # pieces[0] = FlatPiece("blocks.0.fc.weight", torch.Size([8, 6]), 40, 48, 0): elements [40, 48) of the
    # flattened weight sit at shard[0:8]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardkit.nn.fsdp.flat_param import FlatParamMeta


class FlatPiece(NamedTuple):
    """Elements ``[start, stop)`` of the flattened full tensor ``fqn`` (shape ``shape``) sit at
    ``shard.view(-1)[local_offset : local_offset + stop - start]``."""

    fqn: str
    shape: torch.Size
    start: int
    stop: int
    local_offset: int


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone at the root."""
    return f"{prefix}.{name}" if prefix else name


def flat_param_pieces(prefix: str, meta: FlatParamMeta) -> list[FlatPiece]:
    """The pieces of original parameters this rank's shard of one flat parameter holds, in shard order.

    ``prefix`` is the clean path of the unit owning the flat parameter (``""`` for the root). Padding holds no
    parameter and yields no piece; a rank whose chunk is all padding gets an empty list.
    """
    pieces = []
    for s in meta.shard_slices():
        info = meta.params[s.param_index]
        pieces.append(FlatPiece(join_name(prefix, info.fqn), info.shape, s.param_start, s.param_end, s.shard_start))
    return pieces


def flat_param_aliases(prefix: str, meta: FlatParamMeta) -> dict[str, str]:
    """Tied names stored in one flat parameter: alias name -> the name whose values are stored."""
    return {join_name(prefix, s.fqn): join_name(prefix, meta.params[s.primary].fqn) for s in meta.shared}


def unit_replicas(
    unit_name: str, shard_size: int, replica_rank: int, replica_count: int, world_size: int
) -> tuple[int, int]:
    """``(replica_rank, replica_count)`` of a unit whose shard group has ``shard_size`` ranks, checked.

    The ranks holding the same shards are the unit's replica group (hybrid sharding: the same local rank on every
    node; NO_SHARD: every rank); without one, the unit must shard over the whole job. Anything else (a unit over a
    subgroup with no replicas, e.g. per-rank experts) may hold different values per group, which one checkpoint key
    cannot: refused.

    Example::

        >>> unit_replicas("blocks.0", 4, 1, 2, 8)   # hybrid: node 1's copy of 4-way shards, 2 nodes
        (1, 2)
    """
    if shard_size * replica_count != world_size:
        raise ValueError(
            f"FSDP unit '{unit_name}' is sharded over {shard_size} ranks with {replica_count} replica(s), which is "
            f"not the {world_size} ranks of this job: its groups may hold different values (e.g. per-rank experts), "
            "which one checkpoint cannot store. Shard every unit over the whole job, or use "
            "sharding_strategy=HYBRID_SHARD for replicas across nodes"
        )
    if not 0 <= replica_rank < replica_count:
        raise ValueError(f"FSDP unit '{unit_name}': replica rank {replica_rank} is outside 0..{replica_count - 1}")
    return replica_rank, replica_count
