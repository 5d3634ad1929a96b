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


def unit_replicas(global_rank: int, global_world: int, group_size: int) -> tuple[int, int]:
    """``(replica_rank, replica_count)`` of a unit sharded over groups of ``group_size`` ranks.

    Hybrid sharding shards inside a node and replicates across nodes; torchrun numbers the ranks of a node
    contiguously, so the ranks holding the same chunk are ``group_size`` apart and this rank's replica index is
    its node index. A unit over the whole world has one replica.

    Example::

        >>> unit_replicas(5, 8, 4)   # rank 5 of 8, nodes of 4: the second node's copy of chunk 1
        (1, 2)
    """
    if group_size < 1 or global_world % group_size:
        raise ValueError(
            f"an FSDP unit is sharded over {group_size} ranks, which does not divide the world size {global_world}; "
            "the checkpoint cannot tell which ranks hold the same shard. Shard each unit over the whole world or "
            "over equal node groups"
        )
    if not 0 <= global_rank < global_world:
        raise ValueError(f"rank {global_rank} is outside a world of {global_world} ranks")
    return global_rank // group_size, global_world // group_size
