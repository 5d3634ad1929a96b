"""``shardkit plan`` with tensor parallelism: the planned rank's split parameters are 1/t of the unsplit ones, the
bytes its blocks' all-reduces send are the formula's, and the plan matches a real 4-process run (TP 2 x data 2)."""

from __future__ import annotations

import functools

import pytest
import torch

from shardkit.models.tp_lm import tp_comm_bytes, tp_lm
from shardkit.plan import Estimate, estimate
from shardkit.plan.accuracy import compare
from shardkit.plan.workloads import Workload, next_token_cross_entropy

DIM, LAYERS, BATCH, SEQ = 64, 2, 2, 16
#: The split projections per block: q, k, v, o (dim x dim) and up, down (dim x 4 dim), in fp32 bytes.
SPLIT_BYTES = LAYERS * (4 * DIM * DIM + 2 * DIM * 4 * DIM) * 4


def _plan(tensor_parallel: int, strategy: str = "oss_sdp") -> Estimate:
    build = functools.partial(tp_lm, parallel=tensor_parallel > 1, dim=DIM, layers=LAYERS)
    batch = (torch.randint(0, 512, (BATCH, SEQ)),)
    return estimate(
        build, batch, loss_fn=next_token_cross_entropy, strategy=strategy, world_size=4,
        tensor_parallel=tensor_parallel, backend="gloo",
    )  # fmt: skip


@pytest.mark.single  # the planner's peerless world is a process group in this process
def test_plan_at_tensor_parallel_2_holds_half_the_split_layers_and_sends_the_formula() -> None:
    one, two = _plan(1), _plan(2)  # OSS + ShardedDataParallel keep whole parameters on every rank
    assert two.tensor_parallel == 2 and "oss_sdp x4 (tensor-parallel 2)" in two.format()
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


@pytest.mark.single
def test_plan_cli_plans_a_factory_tensor_parallel_model(capsys: pytest.CaptureFixture[str]) -> None:
    from shardkit.plan.cli import main

    argv = ["shardkit.models.tp_lm:tp_lm", "--batch-shape", "2,16", "--strategies", "fsdp"]
    assert main([*argv, "--world-sizes", "3,4", "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "world size 4: recommended" in out
    assert "x3: not planned with tensor parallelism 2" in out


class _SequenceParallelMLP(torch.nn.Module):
    """Embedding, then a sequence-parallel feed-forward on this rank's slice of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        from shardkit import tensor_parallel as tp

        self.rank, self.size = tp.current_state().tp_rank, tp.current_state().tp_size
        self.embed = torch.nn.Embedding(512, DIM)
        self.up = tp.ColumnParallelLinear(DIM, 4 * DIM, bias=False, gather_output=False, sequence_parallel=True)
        self.down = tp.RowParallelLinear(4 * DIM, DIM, bias=False, input_is_parallel=True, sequence_parallel=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = self.embed(tokens).chunk(self.size, dim=1)[self.rank]
        return self.down(torch.nn.functional.gelu(self.up(mine))).mean()


@pytest.mark.single
def test_sequence_parallel_plan_sends_an_all_gather_and_a_reduce_scatter_of_the_all_reduce_bytes() -> None:
    batch = (torch.randint(0, 512, (BATCH, SEQ)),)
    est = estimate(_SequenceParallelMLP, batch, strategy="oss_sdp", world_size=4, tensor_parallel=2, backend="gloo")
    pair = 2 * (2 - 1) * BATCH * SEQ * DIM * 4 // 2  # the bytes of one all-reduce of the full activations
    assert est.comm_bytes_by_phase["forward"] == {"all_gather": pair // 2, "reduce_scatter": pair // 2}
    backward = est.comm_bytes_by_phase["backward"]
    assert (backward["all_gather"], backward["reduce_scatter"]) == (pair // 2, pair // 2)
