"""Planned memory and traffic against real gloo runs: peak and state within 10% of torch's MemTracker and the
real tensors, bytes sent equal to the comm meter's count (see shardkit.plan.accuracy for the conventions)."""

from __future__ import annotations

import pytest

from shardkit.plan.accuracy import compare
from shardkit.plan.workloads import Workload

ALL = ["ddp", "oss_ddp", "oss_sdp", "fsdp", "slowmo", "smp"]

CASES = [
    pytest.param(Workload.demo_lm(batch_size=4), ALL, 2, id="demo_lm-ws2"),
    pytest.param(
        Workload.demo_lm(batch_size=8, strategy_options={"partitions": 2, "microbatches": 4}),
        ["smp"],
        4,
        id="demo_lm_pipeline-ws4",
    ),
    pytest.param(
        Workload("bench_lm", overrides={"n_layers": 2, "d_model": 128}, batch_size=2, seq_len=64),
        ["ddp", "oss_sdp", "fsdp"],
        4,
        id="bench_lm_2layers-ws4",
    ),
    pytest.param(  # ShardedDataParallel reduces by direct sends at two ranks on gloo: the owner's receive buffers
        Workload("bench_lm", overrides={"n_layers": 2, "d_model": 512}, batch_size=2, seq_len=64),
        ["oss_sdp"],
        2,
        id="bench_lm_wide-ws2-sdp_sends",
    ),
    pytest.param(  # activation checkpointing: recomputed blocks, exactly what the real run holds
        Workload(
            "bench_lm",
            overrides={"n_layers": 2, "d_model": 128},
            batch_size=2,
            seq_len=64,
            activation_checkpointing=True,
        ),
        ["ddp", "fsdp"],
        2,
        id="bench_lm_checkpointed-ws2",
    ),
    pytest.param(  # ... with the saved inputs in host memory (planned apart, compared together with the device's)
        Workload(
            "bench_lm",
            overrides={"n_layers": 2, "d_model": 128},
            batch_size=2,
            seq_len=64,
            activation_checkpointing=True,
            offload_activations=True,
        ),
        ["fsdp"],
        2,
        id="bench_lm_checkpoints_on_cpu-ws2",
    ),
    pytest.param(  # CPU offload: the planned device and host memory together against the CPU run's one memory
        Workload.demo_lm(batch_size=4, strategy_options={"cpu_offload": True, "mixed_precision": True}),
        ["fsdp"],
        2,
        id="demo_lm-ws2-fsdp_offload",
    ),
    pytest.param(
        Workload.hf("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32}, batch_size=2, seq_len=32),
        ["oss_ddp", "fsdp"],
        2,
        id="gpt2_tiny-ws2",
    ),
]


@pytest.mark.parametrize(("work", "strategies", "world_size"), CASES)
def test_plan_matches_real_run(work: Workload, strategies: list[str], world_size: int) -> None:
    for row in compare(work, strategies, world_size):
        assert abs(row.peak_error) <= 0.10, row.format()
        assert abs(row.state_error) <= 0.10, row.format()
        assert row.planned_comm == row.real_comm, row.format()
        assert row.planned_comm > 0, row.format()  # every strategy here communicates every step


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("fsdp", {"sharding_strategy": "HYBRID_SHARD"}), ("oss_sdp", {"hybrid": True})],
    ids=["fsdp_hybrid", "oss_sdp_hybrid"],
)
def test_hybrid_plan_matches_real_run_with_inter_node_bytes(strategy: str, options: dict[str, object]) -> None:
    work = Workload("demo_lm", batch_size=4, seq_len=32, strategy_options=options, nprocs_per_node=2)
    (row,) = compare(work, [strategy], 4)
    assert abs(row.peak_error) <= 0.10, row.format()
    assert abs(row.state_error) <= 0.10, row.format()
    assert row.planned_comm == row.real_comm, row.format()
    assert 0 < row.planned_inter == row.real_inter < row.planned_comm, row.format()
