"""``shardkit plan`` with tensor parallelism: the planned rank's split parameters are 1/t of the unsplit ones, the
bytes its blocks' all-reduces send are the formula's, and the plan matches a real 4-process run (TP 2 x data 2)."""

from __future__ import annotations

import functools

import pytest
import torch

from shardkit.models.tp_lm import tp_comm_bytes, tp_lm
from shardkit.plan import estimate
from shardkit.plan.accuracy import compare
from shardkit.plan.workloads import Workload, next_token_cross_entropy

DIM, LAYERS, BATCH, SEQ = 64, 2, 2, 16
#: The split projections per block: q, k, v, o (dim x dim) and up, down (dim x 4 dim), in fp32 bytes.
SPLIT_BYTES = LAYERS * (4 * DIM * DIM + 2 * DIM * 4 * DIM) * 4


def _plan(tensor_parallel: int, strategy: str = "oss_sdp") -> object:
    build = functools.partial(tp_lm, parallel=tensor_parallel > 1, dim=DIM, layers=LAYERS)
    batch = (torch.randint(0, 512, (BATCH, SEQ)),)
    return estimate(
        build, batch, loss_fn=next_token_cross_entropy, strategy=strategy, world_size=4,
        tensor_parallel=tensor_parallel, backend="gloo",
    )  # fmt: skip


@pytest.mark.single  # the planner's peerless world is a process group in this process
def test_plan_at_tensor_parallel_2_holds_half_the_split_layers_and_sends_the_formula() -> None:
    one, two = _plan(1), _plan(2)  # OSS + ShardedDataParallel keep whole parameters on every rank
    assert two.tensor_parallel == 2
    params = one.state_breakdown["parameters"] - two.state_breakdown["parameters"]
    assert params == SPLIT_BYTES // 2  # each rank keeps 1/2 of every split layer, the rest whole
    # FSDP's own traffic is all-gathers and reduce-scatters: its all-reduces are the split blocks'
    fsdp = _plan(2, "fsdp").comm_bytes_by_phase
    want = tp_comm_bytes(BATCH, SEQ, DIM, LAYERS, 2)
    assert (fsdp["forward"]["all_reduce"], fsdp["backward"]["all_reduce"]) == (want["forward"], want["backward"])
    assert "all_reduce" not in _plan(1, "fsdp").comm_bytes_by_phase["backward"]


@pytest.mark.single
def test_plan_rejects_a_tensor_parallel_degree_that_does_not_divide_the_world() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel=3 does not divide world_size=4.*\[1, 2, 4\]"):
        _plan(3)


@pytest.mark.multi
def test_tensor_parallel_plan_matches_a_real_run_of_tp_2_times_data_2() -> None:
    work = Workload(
        "factory", "shardkit.models.tp_lm:tp_lm", {"dim": DIM, "layers": LAYERS, "vocab": 64}, batch_size=BATCH,
        seq_len=SEQ, tensor_parallel=2,
    )  # fmt: skip
    for row in compare(work, ["fsdp", "oss_sdp"], 4):
        assert abs(row.peak_error) <= 0.05, row.format()
        assert abs(row.state_error) <= 0.05, row.format()
        assert row.planned_comm == row.real_comm > 0, row.format()
