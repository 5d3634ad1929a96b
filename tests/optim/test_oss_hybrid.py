"""OSS with hybrid sharding under torch DDP: optimizer state sharded inside each node, replicated across nodes,
trains exactly like the unsharded optimizer at world size 4 laid out as 2 nodes x 2."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import count_comm_bytes
from shardkit.distributed.topology import Topology
from shardkit.optim import OSS
from shardkit.optim.zero1.consistency import _same
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import OPTIMIZERS, rank_batch, tiny_model

TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2)} for r in range(4)]


def _under_ddp(rank: int, world_size: int) -> tuple[float, int, int]:
    topo = Topology.from_env()
    base = tiny_model("lm")
    ref_inner, inner = copy.deepcopy(base), copy.deepcopy(base)
    ref, model = DDP(ref_inner), DDP(inner)
    cls, kwargs = OPTIMIZERS["adamw"]
    ref_opt = cls(ref_inner.parameters(), **kwargs)
    opt = OSS(inner.parameters(), optim=cls, group=topo, **kwargs)
    assert opt.world_size == 2 and opt.rank == topo.local_rank and opt.replica_group is topo.inter_group
    worst = 0.0
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            x, y = rank_batch("lm", m, rank, step)
            loss_for("lm", m(x), y).backward()
        got = opt.clip_grad_norm(0.5)
        want = torch.nn.utils.get_total_norm([p.grad for p in ref_inner.parameters()])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        # The reference clips by the same norm, so the parameters compare the sharded step alone: the norm's two
        # summation orders differ in the last bits, and which bits depends on the CPU's vector width.
        torch.nn.utils.clip_grads_with_norm_(ref_inner.parameters(), 0.5, got)
        ref_opt.step()
        with count_comm_bytes() as meter:
            opt.step()
        worst = max(worst, max((p - q).abs().max().item() for p, q in zip(ref_inner.parameters(), inner.parameters())))
    # The whole optimizer state, gathered inside the node, equals the unsharded optimizer's on every node.
    opt.consolidate_state_dict(recipient_rank=0)
    if opt.rank == 0:
        got, want_sd = opt.state_dict(), ref_opt.state_dict()
        assert sorted(got["state"]) == sorted(want_sd["state"])
        for key, state in want_sd["state"].items():
            torch.testing.assert_close(got["state"][key]["exp_avg"], state["exp_avg"], atol=1e-6, rtol=1e-5)
    owned = sum(p.numel() for p in opt.local_params)
    total = sum(p.numel() for p in inner.parameters())
    # The step's broadcast stays inside the node: only the other local rank's shard arrives here.
    assert meter.payload_bytes.get("all_reduce", 0) == 0
    return worst, owned, total


def test_oss_hybrid_under_ddp_matches_the_unsharded_optimizer() -> None:
    results = run_distributed(_under_ddp, 4, rank_env=TWO_NODES)
    assert max(worst for worst, _, _ in results) < 1e-5
    # State is split between the two ranks of a node and repeated on the other node.
    assert results[0][1] + results[1][1] == results[0][2]
    assert (results[0][1], results[1][1]) == (results[2][1], results[3][1])


def _node_only_ddp(rank: int, world_size: int) -> bool:
    topo = Topology.from_env()
    inner = tiny_model("lm")
    model = DDP(inner, process_group=topo.intra_group)  # the mistake: gradients averaged inside the node only
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = OSS(inner.parameters(), optim=cls, group=topo, **kwargs)
    x, y = rank_batch("lm", model, rank, 0)  # each rank its own data, as a DistributedSampler gives
    loss_for("lm", model(x), y).backward()
    before = [p.detach().clone() for p in inner.parameters()]
    with pytest.raises(ValueError, match=r"differ between nodes.*over the whole world"):
        opt.step()
    return all(torch.equal(p, q) for p, q in zip(before, inner.parameters()))  # nothing stepped


def test_oss_hybrid_refuses_gradients_that_differ_between_nodes_on_every_rank() -> None:
    assert run_distributed(_node_only_ddp, 4, rank_env=TWO_NODES) == [True] * 4


def test_gradient_digests_compare_with_rounding_and_overflow_in_mind() -> None:
    assert _same([1.0, None, math.inf], [1.0 + 1e-9, None, math.nan])  # overflow on both nodes: the scaler's case
    assert not _same([1.0], [1.1]) and not _same([None], [1.0]) and not _same([math.inf], [1.0])
