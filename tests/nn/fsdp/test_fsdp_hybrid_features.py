"""Hybrid sharding with the rest of FSDP: explicit group pairs and meshes, the wrap API, mixed precision, CPU
offload, state dicts, and the errors for node layouts that cannot work (raised on every rank, nothing changed)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testlib import BATCH, LR, build_fsdp, build_reference, ddp_reference, full_params, run_parity, step
from torch import nn

from shardkit.distributed.topology import Topology
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import ShardingStrategy
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.testing import models as M
from shardkit.testing import run_distributed

HYBRID = ShardingStrategy.HYBRID_SHARD
TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2)} for r in range(4)]


def _node_groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    # Every rank creates every group in the same order (torch's new_group rule).
    intra = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    inter = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    return intra[rank // 2], inter[rank % 2]


def _explicit_groups(rank: int, world_size: int) -> None:
    pair = _node_groups(rank)
    run_parity(rank, world_size, "lm", nested=True, process_group=pair, sharding_strategy=HYBRID)
    # A pair without a strategy means hybrid sharding (ZeRO-2 flavour with reshard_after_forward=False).
    model = build_fsdp("nested", rank, world_size, nested=False, process_group=pair, reshard_after_forward=False)
    assert model.sharding_strategy is ShardingStrategy._HYBRID_SHARD_ZERO2
    assert model.world_size == 2 and model.replica_group is pair[1]
    run_parity(
        rank, world_size, "nested", nested=True, process_group=Topology.from_groups(*pair), sharding_strategy=HYBRID
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))  # dim 0 across nodes, dim 1 inside a node
    run_parity(rank, world_size, "nested", nested=True, process_group=mesh, sharding_strategy=HYBRID)


def test_explicit_pair_topology_and_mesh_match_ddp() -> None:
    run_distributed(_explicit_groups, 4)


def _with_features(rank: int, world_size: int) -> None:
    # CPU offload (shards and their gradients stay in CPU memory) and prefetching.
    run_parity(rank, world_size, "nested", nested=True, sharding_strategy=HYBRID, cpu_offload=True)
    run_parity(
        rank,
        world_size,
        "lm",
        nested=True,
        sharding_strategy=HYBRID,
        forward_prefetch=True,
        micro_batches=2,
        use_no_sync=True,
    )
    # Mixed precision: bf16 compute, FP32 reduction; matches full sharding (same arithmetic, summed in two levels).
    results = {}
    for strategy in ShardingStrategy:
        model = build_fsdp(
            "lm",
            rank,
            world_size,
            nested=True,
            sharding_strategy=strategy,
            mixed_precision=True,
            compute_dtype=torch.bfloat16,
            fp32_reduce_scatter=True,
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        for i in range(2):
            step("lm", model, opt, rank, i)
        results[strategy] = full_params(model)
    for strategy in ShardingStrategy:
        for name, value in results[strategy].items():
            want = results[ShardingStrategy.FULL_SHARD][name]
            torch.testing.assert_close(
                value, want, atol=1e-3, rtol=0, msg=lambda m, n=name, s=strategy: f"{s} {n}: {m}"
            )
    # The wrap API passes the strategy to every unit it builds.
    ref = build_reference("lm", rank)
    ddp = ddp_reference("lm", ref)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={M.Block})
    with enable_wrap(wrapper_cls=FSDP, sharding_strategy=HYBRID):
        model = auto_wrap(M.build("lm", seed=0), auto_wrap_policy=policy)
    model = FSDP(model, sharding_strategy=HYBRID)
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    assert len(units) > 1 and all(u.sharding_strategy is HYBRID and u.world_size == 2 for u in units)
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(2):
        assert abs(step("lm", ddp, opt_ref, rank, i) - step("lm", model, opt, rank, i)) < 1e-5
    # Full state dict: gathered inside the node, equal to the reference everywhere; loads back.
    state = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(state)
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[name], atol=1e-5, rtol=1e-5)
    # Gradient clipping sees the true global norm (shards are replicated across nodes, counted once).
    opt.zero_grad()
    x, y = M.make_batch("lm", model.module, BATCH, seed=rank)
    M.loss_for("lm", model(x), y).backward()
    ddp.zero_grad()
    M.loss_for("lm", ddp(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.testing.assert_close(model.clip_grad_norm_(1.0), want, atol=1e-5, rtol=1e-5)


def test_mixed_precision_offload_wrap_and_state_dict_under_hybrid() -> None:
    run_distributed(_with_features, 4, rank_env=TWO_NODES)


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    intra, inter = _node_groups(rank)
    messages = []
    cases = [
        dict(process_group=(intra, intra), sharding_strategy=HYBRID),  # does not tile the world
        dict(process_group=(intra, inter), sharding_strategy=ShardingStrategy.FULL_SHARD),  # pair without hybrid
        dict(sharding_strategy=HYBRID, reshard_after_forward=False),  # conflicting fairscale argument
        dict(sharding_strategy="HYBRID_SHARD"),  # not the enum
    ]
    from torch.distributed.device_mesh import init_device_mesh

    cases.append(dict(process_group=init_device_mesh("cpu", (4,)), sharding_strategy=HYBRID))  # wrong shape
    for kwargs in cases:
        layer = nn.Linear(4, 4)
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        with pytest.raises((ValueError, TypeError)) as info:
            FSDP(layer, **kwargs)
        messages.append(str(info.value))
        assert {n: p for n, p in layer.named_parameters()}.keys() == before.keys()  # left unchanged
    return messages


def test_bad_node_layouts_raise_on_every_rank() -> None:
    results = run_distributed(_bad_inputs, 4, rank_env=TWO_NODES)
    tile, pair, reshard, kind, mesh = results[0]
    assert "intra-node group sizes" in tile or "inter-node group" in tile
    assert "HYBRID_SHARD" in pair and "describes nodes" in pair
    assert "reshard_after_forward=False" in reshard
    assert "sharding_strategy must be one of" in kind
    assert "2-D DeviceMesh" in mesh
    assert all(r[0].split(":")[0] == tile.split(":")[0] for r in results)


def _uneven_nodes(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as info:
        FSDP(nn.Linear(4, 4), sharding_strategy=HYBRID)
    return str(info.value)


@pytest.mark.parametrize("sizes", [("3", "3", "3", "3"), ("2", "2", "1", "1")])
def test_node_sizes_that_cannot_work_raise_everywhere(sizes: tuple[str, ...]) -> None:
    # A node size that does not divide the world, and nodes started with different --nproc-per-node.
    env = [{"LOCAL_WORLD_SIZE": size} for size in sizes]
    messages = run_distributed(_uneven_nodes, 4, rank_env=env)
    assert len(set(messages)) == 1 and "LOCAL_WORLD_SIZE" in messages[0]


def _dcp_round_trip(rank: int, world_size: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = build_fsdp("lm", rank, world_size, nested=True, sharding_strategy=HYBRID)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step("lm", model, opt, rank, 0)
    dcp.save(model.sharded_state_dict(), checkpoint_id=path)  # both nodes hold every shard: written once
    fresh = build_fsdp("lm", rank, world_size, nested=True, sharding_strategy=HYBRID)
    target = fresh.sharded_state_dict()
    dcp.load(target, checkpoint_id=path)
    fresh.load_sharded_state_dict(target)
    want, got = full_params(model), full_params(fresh)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=0, rtol=0)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_dcp_sharded_state_dict_round_trip_under_hybrid(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    states = run_distributed(_dcp_round_trip, 4, path, rank_env=TWO_NODES)
    import torch.distributed.checkpoint as dcp

    plain = M.build("lm", seed=5)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=True)  # an ordinary checkpoint of the unwrapped model
    for name, value in states[0].items():
        torch.testing.assert_close(sd[name], torch.from_numpy(value), atol=0, rtol=0)
        torch.testing.assert_close(torch.from_numpy(states[3][name]), torch.from_numpy(value), atol=0, rtol=0)


def _one_replica_differs(rank: int, world_size: int) -> str:
    # Only rank 3 (node 1, local rank 1) built another model: every rank must raise, none may wait.
    layer = nn.Linear(4, 5 if rank == 3 else 4)
    with pytest.raises(ValueError) as info:
        FSDP(layer, sharding_strategy=HYBRID)
    return str(info.value)


def test_a_replica_with_another_model_fails_every_rank() -> None:
    messages = run_distributed(_one_replica_differs, 4, rank_env=TWO_NODES, timeout_s=60)
    assert all("rank" in m for m in messages)
