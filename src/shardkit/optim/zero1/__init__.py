"""ZeRO stage 1: optimizer state sharded across data-parallel ranks.

- :mod:`.partition` decides which rank owns each parameter (balanced by size, identical on every rank).
- :mod:`.optimizer` holds :class:`OSS`, the ``torch.optim.Optimizer`` that steps only its shard.
- :mod:`.broadcast` sends updated parameters from owners to every rank in flat buckets.
- :mod:`.clip` clips gradients by the global norm computed from the shards.
- :mod:`.state_dict` converts between sharded state and plain ``torch.optim`` state dicts.
- :mod:`.consistency` refuses, at construction, ranks that hold different parameters.
"""

from shardkit.optim.zero1.optimizer import OSS

__all__ = ["OSS"]
