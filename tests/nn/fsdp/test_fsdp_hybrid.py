"""Hybrid sharding and torch FSDP's sharding strategies: parity with DDP at world size 4 laid out as 2 nodes x 2.

The nodes are simulated the way torchrun describes them (LOCAL_WORLD_SIZE=2, GROUP_RANK = node) through the
harness's per-rank environment, or given explicitly as an (intra, inter) group pair or a 2-D DeviceMesh.
"""

from __future__ import annotations

from fsdp_testlib import build_fsdp, run_parity

from shardkit.nn.fsdp import ShardingStrategy
from shardkit.testing import run_distributed

TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2)} for r in range(4)]


def _every_strategy(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    sizes = {}
    for strategy in ShardingStrategy:
        for name in ("lm", "nested", "batchnorm"):
            run_parity(rank, world_size, name, nested=True, sharding_strategy=strategy)
        model = build_fsdp("lm", rank, world_size, nested=True, sharding_strategy=strategy)
        local = sum(p.numel() for p in model.parameters())
        with model.summon_full_params(writeback=False):
            full = sum(p.numel() for p in model.parameters())
        sizes[strategy.name] = (local, full)
        assert model.sharding_strategy is strategy
    return sizes


def test_every_strategy_matches_ddp_on_two_nodes() -> None:
    results = run_distributed(_every_strategy, 4, rank_env=TWO_NODES)
    for rank_sizes in results:
        full = rank_sizes["FULL_SHARD"][1]
        # Per-rank parameter memory: 1/4 sharded over the world, 1/2 inside a node, all of it unsharded.
        for name, share in [("FULL_SHARD", 4), ("SHARD_GRAD_OP", 4), ("HYBRID_SHARD", 2), ("_HYBRID_SHARD_ZERO2", 2)]:
            local, total = rank_sizes[name]
            assert total == full
            assert full / share <= local < full / share + 64, (name, local, full)  # padding only
        assert rank_sizes["NO_SHARD"][0] == full
