"""smp's common API: rank helpers for every group, smp.CommGroup / smp.RankType, and the object communication
calls (allgather, broadcast + recv_from, send + recv_from, barrier), at world sizes 2 and 4 with pipeline x data
parallelism; bad calls fail with a clear error instead of hanging."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp_testlib import batch, mlp

import shardkit.modelparallel as smp
from shardkit.distributed import check_collectives
from shardkit.testing import DistributedTestError, run_distributed
from testkit.smp import mse_step

RANK_TYPE = {
    smp.WORLD: smp.RankType.WORLD_RANK,
    smp.MP_GROUP: smp.RankType.MP_RANK,
    smp.PP_GROUP: smp.RankType.PP_RANK,
    smp.DP_GROUP: smp.RankType.DP_RANK,
    smp.RDP_GROUP: smp.RankType.RDP_RANK,
}


def _expected(rank: int, world_size: int, partitions: int, placement: str = "cluster") -> dict[str, Any]:
    """The topology, worked out here independently of shardkit's Topology: "cluster" puts a replica's stages on
    neighbouring ranks, "spread" as far apart as possible."""
    replicas = world_size // partitions
    if placement == "cluster":
        mp, dp = rank % partitions, rank // partitions
        mp_group = [dp * partitions + s for s in range(partitions)]
        dp_group = [d * partitions + mp for d in range(replicas)]
    else:
        mp, dp = rank // replicas, rank % replicas
        mp_group = [s * replicas + dp for s in range(partitions)]
        dp_group = [mp * replicas + d for d in range(replicas)]
    return {
        "rank": rank, "size": world_size, "local_rank": rank, "local_size": world_size,
        "mp_rank": mp, "pp_rank": mp, "dp_rank": dp, "rdp_rank": dp, "tp_rank": 0,
        "mp_size": partitions, "pp_size": partitions, "dp_size": world_size // partitions,
        "rdp_size": world_size // partitions, "tp_size": 1,
        "mp_group": mp_group, "dp_group": dp_group,
        "members": {
            "WORLD": list(range(world_size)), "MP_GROUP": mp_group, "PP_GROUP": mp_group,
            "DP_GROUP": dp_group, "RDP_GROUP": dp_group, "TP_GROUP": [rank],
        },
    }  # fmt: skip


def _helpers() -> dict[str, Any]:
    names = ["rank", "size", "local_rank", "local_size", "mp_rank", "pp_rank", "dp_rank", "rdp_rank", "tp_rank"]
    names += ["mp_size", "pp_size", "dp_size", "rdp_size", "tp_size", "get_mp_group", "get_dp_group"]
    got = {name.replace("get_", ""): getattr(smp, name)() for name in names}
    return got


def _exchange(rank: int, expected: dict[str, Any]) -> dict[str, Any]:
    """Every communication call on every group; returns what each delivered."""
    out: dict[str, Any] = {"allgather": {}, "broadcast": {}, "send": {}}
    for group in smp.CommGroup:
        out["allgather"][group.name] = smp.allgather((rank, group.name), group)
    for group, rank_type in RANK_TYPE.items():  # the group's first member broadcasts, the others receive
        members = expected["members"][group.name]
        if len(members) == 1:
            continue
        if members[0] == rank:
            smp.broadcast({"from": rank, "group": group.name}, group)
        else:
            out["broadcast"][group.name] = smp.recv_from(0, rank_type)
    for group, rank_type in RANK_TYPE.items():  # a ring: send to the next member, receive from the previous
        members = expected["members"][group.name]
        if len(members) == 1:
            continue
        me = members.index(rank)
        nxt, prev = (me + 1) % len(members), (me - 1) % len(members)
        if me % 2 == 0:  # even members send first, odd ones receive first: no rank waits on a rank that waits
            smp.send((rank, group.name), nxt, rank_type)
            out["send"][group.name] = smp.recv_from(prev, rank_type)
        else:
            out["send"][group.name] = smp.recv_from(prev, rank_type)
            smp.send((rank, group.name), nxt, rank_type)
    for group in smp.CommGroup:
        smp.barrier(group)
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    return out


def _errors(expected: dict[str, Any]) -> list[str]:
    """Bad arguments raise at once, before anything is sent (every rank checks its own call)."""
    messages = []
    mp_size = expected["mp_size"]
    for call in (
        lambda: smp.send("x", mp_size, smp.RankType.MP_RANK),  # one past the last stage
        lambda: smp.send("x", expected["rank"], smp.RankType.WORLD_RANK),  # itself
        lambda: smp.recv_from(-1, smp.RankType.DP_RANK),
        lambda: smp.send("x", 0, smp.RankType.TP_RANK),  # the tensor-parallel group is this rank alone
    ):
        with pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value))
    with pytest.raises(TypeError, match=r"smp.allgather takes an smp.CommGroup"):
        smp.allgather(1, "dp")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"smp.send takes an smp.RankType"):
        smp.send(1, 0, smp.DP_GROUP)  # type: ignore[arg-type]
    return messages


def _run(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    smp.init(config)
    try:
        expected = _expected(rank, world_size, config["partitions"], config.get("placement_strategy", "cluster"))
        return {"helpers": _helpers(), "exchange": _exchange(rank, expected), "errors": _errors(expected)}
    finally:
        smp.reset()


CONFIGS = [
    pytest.param(2, {"partitions": 2, "microbatches": 2}, id="ws2-pipeline"),
    pytest.param(2, {"partitions": 1, "ddp": True}, id="ws2-ddp"),
    pytest.param(4, {"partitions": 2, "ddp": True}, id="ws4-2x2"),
    pytest.param(4, {"partitions": 2, "ddp": True, "placement_strategy": "spread"}, id="ws4-2x2-spread"),
]


@pytest.mark.parametrize(("world_size", "config"), CONFIGS)
def test_rank_helpers_and_communication(world_size: int, config: dict[str, Any]) -> None:
    results = run_distributed(_run, world_size, config, timeout_s=120)
    for rank, result in enumerate(results):
        expected = _expected(rank, world_size, config["partitions"], config.get("placement_strategy", "cluster"))
        members = expected.pop("members")
        assert result["helpers"] == expected, rank
        gathered = result["exchange"]["allgather"]
        assert gathered == {name: [(r, name) for r in ranks] for name, ranks in members.items()}, rank
        for name, ranks in members.items():
            if len(ranks) == 1:
                continue
            me = ranks.index(rank)
            if me != 0:
                assert result["exchange"]["broadcast"][name] == {"from": ranks[0], "group": name}
            assert result["exchange"]["send"][name] == (ranks[(me - 1) % len(ranks)], name)
        out_of_group, itself, negative, tensor_group = result["errors"]
        assert f"rank {config['partitions']} (MP_RANK) is outside the MP_GROUP of rank {rank}" in out_of_group
        assert f"(global ranks {expected['mp_group']})" in out_of_group
        assert f"is this process (global rank {rank}) itself" in itself
        assert "rank -1 (DP_RANK) is outside the DP_GROUP" in negative
        assert "is this process" in tensor_group


def test_group_constants_and_version() -> None:
    assert smp.WORLD is smp.CommGroup.WORLD and smp.DP_GROUP is smp.CommGroup.DP_GROUP
    assert {g.name for g in smp.CommGroup} == {"WORLD", "MP_GROUP", "DP_GROUP", "PP_GROUP", "TP_GROUP", "RDP_GROUP"}
    assert {t.name for t in smp.RankType} >= {"WORLD_RANK", "MP_RANK", "DP_RANK"}
    major, minor, _ = (int(part) for part in smp.__version__.split("."))
    assert (major, minor) >= (1, 10)


def test_single_process_groups_are_this_process() -> None:
    smp.init({"partitions": 1})
    try:
        assert [smp.allgather("me", g) for g in smp.CommGroup] == [["me"]] * len(smp.CommGroup)
        smp.broadcast("nobody to send to", smp.WORLD)  # a group of one: nothing to do
        smp.barrier()
        assert smp.get_tp_process_group().size() == 1
        with pytest.raises(ValueError, match="is this process"):
            smp.send("x", 0, smp.RankType.WORLD_RANK)
    finally:
        smp.reset()


def _allgather_on_rank_zero_only(rank: int, world_size: int, then: str) -> str:
    smp.init({"partitions": 1, "ddp": True})
    try:
        with check_collectives(timeout_s=4):  # the check's timeout: 90% of this
            if rank == 0:
                smp.allgather({"loss": 1.0}, smp.DP_GROUP)
            elif then == "other_call":
                smp.barrier(smp.DP_GROUP)
        return "no error"
    finally:
        if then == "skip" or rank == 0:
            smp.reset()


@pytest.mark.parametrize("then", ["skip", "other_call"])
def test_allgather_on_some_ranks_fails_naming_them(then: str) -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_allgather_on_rank_zero_only, 2, then, timeout_s=60)
    message = str(info.value)
    assert "did not finish" not in message  # an error within the check's timeout, not a hang
    if then == "skip":
        assert "rank 0 raised" in message and "MissedCallError" in message
        assert "smp.allgather(obj, DP_GROUP) was called on rank(s) [0], but rank(s) [1] of group [0, 1]" in message
        assert "call them on every member" in message
    else:
        assert "rank 0 raised" in message and "rank 1 raised" in message
        assert "made different calls that every rank must make" in message
        assert "smp.allgather(obj, DP_GROUP)" in message and "smp.barrier(DP_GROUP)" in message


class _Recording(torch.nn.Module):
    """Records smp.is_tracing() at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(smp.is_tracing())
        return self.body(x)


def test_is_tracing_only_during_the_partitioners_forwards() -> None:
    smp.init({"partitions": 1, "microbatches": 2})
    try:
        _check_is_tracing()
    finally:
        smp.reset()


def _check_is_tracing() -> None:
    module = _Recording()
    model = smp.DistributedModel(module)
    x, y = batch("mlp", 8, 0)
    mse_step(model, x, y)
    tracing, real = module.seen[:-2], module.seen[-2:]
    assert tracing and all(tracing)  # the forwards that decided the partition
    assert real == [False, False]  # the step's two micro-batches
    mse_step(model, x, y)
    assert module.seen[-2:] == [False, False] and not smp.is_tracing()


def _script(rank: int, world_size: int) -> list[list[dict[str, float]]]:
    """A SageMaker-style script: plain smp.init(), StepLR, metrics gathered over the replicas each step."""
    smp.init()  # the config comes from $SM_HP_MP_PARAMETERS
    try:
        model = smp.DistributedModel(mlp())
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        reported = []
        for s in range(3):
            x, y = batch("mlp", 8, 100 * s + smp.dp_rank())
            optimizer.zero_grad()
            loss = mse_step(model, x, y).reduce_mean().item()
            optimizer.step()
            reported.append(smp.allgather({"loss": loss, "lr": optimizer.param_groups[0]["lr"]}, smp.DP_GROUP))
            scheduler.step()
        return reported
    finally:
        smp.reset()


def test_sagemaker_style_script_reports_every_replicas_metrics() -> None:
    params = {"partitions": 2, "ddp": True, "microbatches": 2, "pipeline": "interleaved"}
    env = [{"SM_HP_MP_PARAMETERS": json.dumps(params)}] * 4
    results = run_distributed(_script, 4, rank_env=env, timeout_s=120)
    model = mlp()  # the reference: one process, both replicas' batches, their mean loss
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    expected = []
    for s in range(3):
        losses = [F.mse_loss(model(x), y) for x, y in (batch("mlp", 8, 100 * s + d) for d in range(2))]
        optimizer.zero_grad()
        (sum(losses) / 2).backward()
        expected.append([{"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]} for loss in losses])
        optimizer.step()
        scheduler.step()
    # The output stage (mp_rank 1: ranks 1 and 3) computes the loss; the first stage's values are item 3's (the
    # step outputs) concern.
    for rank in (1, 3):
        for got, want in zip(results[rank], expected):
            assert [m["lr"] for m in got] == [m["lr"] for m in want]
            assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=1e-5)
    assert results[1] == results[3]  # every replica got the same gathered list
