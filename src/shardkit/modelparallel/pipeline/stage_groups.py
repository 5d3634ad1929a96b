"""Process groups joining the stages that hold copies of the same parameters (tied or replicated ones)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from shardkit.distributed import GroupLike
from shardkit.modelparallel.partitioning.plan import PipelinePlan
from shardkit.modelparallel.state import SMPState


def copy_groups(
    plan: PipelinePlan, params: dict[str, nn.Parameter], state: SMPState
) -> list[tuple[GroupLike, list[nn.Parameter]]]:
    """For each set of stages sharing parameters, this rank's group over that set and the parameters it shares.

    Collective over the world: every rank creates every group (one per stage set and replica), in the same
    order. A set covering all stages reuses the model-parallel group.
    """
    topo = state.topology
    stage = topo.mp_rank
    sets = sorted({stages for name, stages in plan.holders.items() if len(stages) > 1 and name in params})
    result: list[tuple[GroupLike, list[nn.Parameter]]] = []
    for stages in sets:
        group: Any = None
        if stages == tuple(range(topo.mp_size)):
            group = state.mp_group
        else:
            for dp_rank in range(topo.dp_size):
                created = dist.new_group([topo.rank_of(s, dp_rank) for s in stages])
                state.owned_groups.append(created)
                if dp_rank == topo.dp_rank:
                    group = created
        if stage in stages:
            shared = [params[n] for n in sorted(params) if plan.holders.get(n) == stages and params[n].requires_grad]
            if shared:
                result.append((group, shared))
    return result
