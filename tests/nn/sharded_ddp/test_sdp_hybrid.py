"""OSS + ShardedDataParallel with hybrid sharding (state sharded inside a node, replicated across nodes) trains
like torch DDP at world size 4 laid out as 2 nodes x 2; bad node layouts fail on every rank."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from sdp_testlib import freeze_null_gradients
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import count_comm_bytes
from shardkit.distributed.topology import Topology
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import OPTIMIZERS, BranchyNet, rank_batch, tiny_model

TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2)} for r in range(4)]


def _train(rank: int, name: str, optim: str, nodes: Any, accumulate: int = 1, **sdp_kwargs: Any) -> float:
    """DDP reference and OSS+SDP over ``nodes`` side by side; returns the largest parameter gap seen."""
    unused = name == "branchy"
    base = BranchyNet() if unused else tiny_model(name)
    if optim == "adamw":
        freeze_null_gradients(name, base)
    ref_inner, inner = copy.deepcopy(base), copy.deepcopy(base)
    cls, kwargs = OPTIMIZERS[optim]
    ref = DDP(ref_inner, find_unused_parameters=unused)
    ref_opt = cls([p for p in ref_inner.parameters() if p.requires_grad], **kwargs)
    opt = OSS([p for p in inner.parameters() if p.requires_grad], optim=cls, group=nodes, **kwargs)
    assert opt.world_size == 2 and opt.replica_group is not None
    sdp = ShardedDataParallel(inner, opt, **sdp_kwargs)
    assert sdp.replica_group is opt.replica_group
    worst = 0.0
    for step in range(3):
        for model in (ref, sdp):
            for micro in range(accumulate):
                quiet = micro < accumulate - 1
                with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                    x, y = rank_batch("nested" if unused else name, model, rank, step, micro)
                    # BranchyNet: node 0 runs one branch and node 1 the other, so some gradients exist on one
                    # node only and must still be averaged over all four ranks.
                    extra = {"use_b": (rank // 2 + step) % 2 == 0} if unused else {}
                    loss_for("nested" if unused else name, model(x, **extra), y).backward()
        owner_of = opt.param_to_rank
        for (pname, p), q in zip(ref_inner.named_parameters(), inner.parameters()):
            if q not in owner_of:
                continue
            if owner_of[q] != opt.rank:
                assert q.grad is None, f"rank {rank} keeps a gradient of {pname} it does not own"
            elif p.grad is None:
                assert q.grad is None, pname
            else:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=pname: f"{n}: {m}")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        worst = max(worst, max((p - q).abs().max().item() for p, q in zip(ref_inner.parameters(), inner.parameters())))
    return worst


def _node_groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    intra = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    inter = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    return intra[rank // 2], inter[rank % 2]


def _parity(rank: int, world_size: int) -> list[float]:
    topo = Topology.from_env()
    gaps = [
        _train(rank, "lm", "sgd", topo),
        _train(rank, "lm", "adamw", _node_groups(rank)),
        _train(rank, "branchy", "sgd", topo, reduce_buffer_size=0),
        _train(rank, "nested", "sgd", topo, accumulate=2),
    ]
    from torch.distributed.device_mesh import init_device_mesh

    gaps.append(_train(rank, "nested", "sgd", init_device_mesh("cpu", (2, 2))))
    return gaps


def test_oss_sdp_hybrid_matches_ddp_on_two_nodes() -> None:
    for gaps in run_distributed(_parity, 4, rank_env=TWO_NODES):
        assert max(gaps) < 1e-5, gaps


def _traffic(rank: int, world_size: int) -> tuple[int, int]:
    """Bytes this rank sends per step: reduce inside the node, all-reduce of the owner's shard across nodes."""
    topo = Topology.from_env()
    model = tiny_model("lm")
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=topo, lr=0.1)
    sdp = ShardedDataParallel(model, opt, broadcast_buffers=False)
    x, y = rank_batch("lm", sdp, rank, 0)
    with count_comm_bytes() as meter:
        loss_for("lm", sdp(x), y).backward()
    owned = sum(p.numel() * p.element_size() for p in opt.local_params)
    return owned, meter.payload_bytes.get("all_reduce", 0)


def test_only_owned_gradients_are_all_reduced_across_nodes() -> None:
    for owned, all_reduced in run_distributed(_traffic, 4, rank_env=TWO_NODES):
        # The owner's shard plus one small used-flags vector per group; never the whole model.
        assert owned <= all_reduced <= owned + 4096, (owned, all_reduced)


def _refusals(rank: int, world_size: int) -> list[str]:
    intra, inter = _node_groups(rank)
    messages = []
    with pytest.raises(ValueError) as info:  # a pair that does not tile the world
        OSS(nn.Linear(4, 4).parameters(), group=(intra, intra), lr=0.1)
    messages.append(str(info.value))
    # One node built a different model: refused on both nodes (the replicas are compared too).
    model = nn.Linear(4, 4 if rank < 2 else 5)
    with pytest.raises(ValueError) as info:
        OSS(model.parameters(), group=(intra, inter), lr=0.1)
    messages.append(str(info.value))
    # SDP given other nodes than its optimizer.
    opt = OSS(nn.Linear(4, 4).parameters(), group=(intra, inter), lr=0.1)
    with pytest.raises(ValueError) as info:
        ShardedDataParallel(nn.Linear(4, 4), opt, process_group=dist.group.WORLD)
    messages.append(str(info.value))
    return messages


def test_bad_layouts_and_models_raise_on_every_rank() -> None:
    for tile, model, mismatch in run_distributed(_refusals, 4):
        assert "Topology.from_groups" in tile
        assert "parameters" in model
        assert "replicas" in mismatch and "OSS" in mismatch
