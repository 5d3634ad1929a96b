"""smp's sharded data parallelism (``sharded_data_parallel_degree``) on shardkit's FullyShardedDataParallel.

smp v1.11+ shards parameters, gradients and optimizer state over a *sharding group* of
``sharded_data_parallel_degree`` reduced-data-parallel ranks (ZeRO-3, smp's MiCS); the sharding groups hold
replicas of each other, and a gradient is reduce-scattered inside its sharding group, then all-reduced across
the groups. Here that is :class:`~shardkit.nn.FullyShardedDataParallel` with hybrid sharding, applied to the model
after the first step's partition plan is known (rank 0's solitary tracing forward runs on the unwrapped model,
so no sharded collective ever runs inside it).

Rooms: :mod:`.rules` (the config keys and smp's rules for them), :mod:`.groups` (which ranks shard together),
:mod:`.wrap` (wrapping the model, pointing the optimizer at the shards, clipping at ``optimizer.step()``),
:mod:`.sync` (what completes a step's gradients), :mod:`.state_dicts` (full and partial state dicts).
"""
