"""Deciding which rank owns (keeps optimizer state for, and updates) each parameter.

The partition is a pure function of the parameters' order, shapes and ``requires_grad`` flags, so every rank
computes the same answer without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def assign_owners(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """Owner rank of each tensor in ``params``, balancing the trainable elements across ranks.

    Trainable tensors are placed largest first on the rank holding the fewest elements so far (ties go to the
    lower rank): the classic longest-processing-time rule, within 4/3 of the best possible balance. Frozen
    tensors carry no optimizer work, so they are placed after all trainable ones and cannot disturb that
    balance; each goes, largest first, to the rank holding the fewest elements in all, so every one has an
    owner that can keep any state it had before it was frozen and the ranks' totals stay even (the balance
    fairscale's ``add_param_group`` promises when a frozen group is added).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    owners = [0] * len(params)
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]
    load = [0] * world_size
    for indices in (trainable, frozen):
        for index in sorted(indices, key=lambda i: (-params[i].numel(), i)):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            owners[index] = rank
            load[rank] += params[index].numel()
    return owners


def _subset_group(group: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """A shallow copy of a param group holding only the parameters at positions ``keep``."""
    subset = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    subset["params"] = [group["params"][i] for i in keep]
    if "param_names" in group:
        subset["param_names"] = [group["param_names"][i] for i in keep]
    return subset


@dataclass(frozen=True)
class Partition:
    """The parameters of a list of param groups split across ``world_size`` ranks.

    ``rank_groups[r]`` holds rank ``r``'s param groups: one per global group, same hyperparameters, only the
    parameters ``r`` owns (possibly none). ``owner`` maps every parameter to its rank; ``trainable`` lists the
    parameters that required grad when the partition was computed, in global order.
    """

    world_size: int
    params: tuple[torch.Tensor, ...]
    owner: dict[torch.Tensor, int]
    trainable: tuple[torch.Tensor, ...]
    rank_groups: tuple[tuple[dict[str, Any], ...], ...]

    @classmethod
    def build(cls, param_groups: Sequence[dict[str, Any]], world_size: int) -> Partition:
        """Partition ``param_groups`` (torch.optim style dicts) over ``world_size`` ranks."""
        params = tuple(p for group in param_groups for p in group["params"])
        owners = assign_owners(params, world_size)
        owner = dict(zip(params, owners))
        rank_groups = []
        for rank in range(world_size):
            groups = []
            for group in param_groups:
                keep = [i for i, p in enumerate(group["params"]) if owner[p] == rank]
                groups.append(_subset_group(group, keep))
            rank_groups.append(tuple(groups))
        trainable = tuple(p for p in params if p.requires_grad)
        return cls(world_size, params, owner, trainable, tuple(rank_groups))

    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Owner of every parameter that requires grad."""
        return {p: self.owner[p] for p in self.trainable}

    def owned(self, rank: int, trainable_only: bool = False) -> list[torch.Tensor]:
        """Parameters owned by ``rank``, in global order."""
        pool = self.trainable if trainable_only else self.params
        return [p for p in pool if self.owner[p] == rank]

    def index_of(self) -> dict[torch.Tensor, int]:
        """Position of each parameter in the global order: the ids of a plain optimizer state dict."""
        return {p: i for i, p in enumerate(self.params)}

    def same_layout(self, other: Partition) -> bool:
        """True when both partitions give every parameter the same owner and the same trainable set."""
        return (
            self.world_size == other.world_size
            and len(self.params) == len(other.params)
            and all(a is b for a, b in zip(self.params, other.params))
            and all(self.owner[p] == other.owner[p] for p in self.params)
            and len(self.trainable) == len(other.trainable)
            and all(a is b for a, b in zip(self.trainable, other.trainable))
        )
