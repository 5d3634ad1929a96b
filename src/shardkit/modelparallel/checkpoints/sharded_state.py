"""``shard_optimizer_state``: each stage's optimizer state sharded over its data-parallel replicas (ZeRO-1).

Built right after the partition (the stage must know which parameters it holds): a
:class:`~shardkit.optim.OSS` over this stage's parameters, with the user's optimizer class and param groups,
sharded over the reduced-data-parallel group (the ranks holding the same tensors: smp's data-parallel group
without tensor parallelism; with it, the ranks of the same tensor-parallel slice). The replicas' gradients are
already averaged by the model's all-reduce, so each replica updates the parameters it owns and broadcasts them to
the others; every replica ends the step with the same parameters as unsharded training, and holds about
``1 / rdp_size`` of the stage's optimizer state.

The ``DistributedOptimizer`` keeps its own ``param_groups`` as the place schedulers and users edit
hyper-parameters; they are copied into the shards before every step. Its ``state`` stays empty: the state lives
in the shards (:attr:`ShardedOptimizerState.oss`). State dicts are torch's format over the user's whole
optimizer, gathered from the shards (a collective over the data-parallel group).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardkit.distributed import GroupLike
from shardkit.optim import OSS
from shardkit.optim.zero1.state_dict import hyperparams


class ShardedOptimizerState:
    """The optimizer state of this stage's parameters, sharded over ``dp_group``.

    ``param_groups`` are the user's optimizer's (every parameter of the model, in its order); ``held`` the ids of
    the parameters this stage holds; ``optim_cls`` and ``defaults`` rebuild the user's optimizer over a shard.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        held: set[int],
        optim_cls: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        dp_group: GroupLike,
    ) -> None:
        groups = []
        #: For each parameter of the shards' groups (in their order), its index in the user's optimizer.
        self.user_index: list[int] = []
        index = 0
        for group in param_groups:
            params = []
            for param in group["params"]:
                if id(param) in held:
                    params.append(param)
                    self.user_index.append(index)
                index += 1
            groups.append({**hyperparams(group), "params": params})
        try:
            self.oss = OSS(groups, optim=optim_cls, group=dp_group, **defaults)
        except TypeError as exc:
            raise TypeError(
                f"shard_optimizer_state rebuilds {optim_cls.__name__} over each shard from its param groups and "
                f"defaults, which failed ({exc}); train this optimizer without 'shard_optimizer_state'"
            ) from exc

    def step(self, param_groups: list[dict[str, Any]], closure: Optional[Callable[[], Any]], **kwargs: Any) -> Any:
        """Copy the user's hyper-parameters into the shards, update the owned parameters, share them (collective
        over the data-parallel group)."""
        for user_group, shard_group in zip(param_groups, self.oss.param_groups):
            shard_group.update(hyperparams(user_group))
        return self.oss.step(closure, **kwargs)

    def gathered_state(self) -> dict[int, Any]:
        """The state of every parameter this stage holds, keyed by its index in the user's optimizer (collective
        over the data-parallel group; on the CPU)."""
        self.oss.consolidate_state_dict(recipient_rank=-1)
        state = self.oss.state_dict()["state"]
        return {self.user_index[int(i)]: value for i, value in state.items()}

    def load(self, full: dict[str, Any]) -> None:
        """Load a full torch-format state dict of the user's optimizer: each shard keeps what it owns."""
        position = {user: i for i, user in enumerate(self.user_index)}
        state = {position[int(i)]: value for i, value in full["state"].items() if int(i) in position}
        groups, start = [], 0
        for saved, shard_group in zip(full["param_groups"], self.oss.param_groups):
            count = len(shard_group["params"])
            groups.append({**hyperparams(saved), "params": list(range(start, start + count))})
            start += count
        self.oss.load_state_dict({"state": state, "param_groups": groups})
