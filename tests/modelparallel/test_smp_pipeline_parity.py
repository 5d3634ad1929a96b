"""Pipelined training with smp equals single-process training: losses and final parameters, within 1e-5.

Every configuration of a world size runs in one multi-process job (``smp.reset`` between them) to keep the
suite fast.
"""

from __future__ import annotations

import pytest
from smp_testlib import ParityCase, check_parity, parity_results

from shardkit.testing import run_distributed


def _schedules(partitions: int, name: str = "mlp") -> list[ParityCase]:
    return [
        (name, {"partitions": partitions, "microbatches": mb, "pipeline": pipeline}, {})
        for pipeline in ("simple", "interleaved")
        for mb in (1, 4, 8)
    ]


@pytest.mark.parametrize("partitions", [2, 4])
def test_pipeline_matches_single_process(partitions: int) -> None:
    """Both schedules with 1, 4 and 8 micro-batches, 2 and 4 stages, on an MLP split automatically."""
    check_parity(run_distributed(parity_results, partitions, _schedules(partitions)))


def test_residual_tuple_model_and_tied_lm_match_single_process() -> None:
    """Not a Sequential: cross-stage residuals, tuple/dict outputs, glue parameters; and an LM with tied weights."""
    cases = [
        ("residual", {"partitions": 4, "microbatches": 4, "auto_partition": False}, {"stages": 4}),
        (
            "residual",
            {"partitions": 4, "microbatches": 8, "pipeline": "simple", "auto_partition": False},
            {"stages": 4},
        ),
        ("lm", {"partitions": 4, "microbatches": 4}, {}),
    ]
    check_parity(run_distributed(parity_results, 4, cases))


def test_two_stage_residual_and_lm() -> None:
    cases = [
        ("residual", {"partitions": 2, "microbatches": 4, "auto_partition": False}, {"stages": 2}),
        ("lm", {"partitions": 2, "microbatches": 8, "pipeline": "simple"}, {}),
        ("lm", {"partitions": 2, "microbatches": 4}, {}),
    ]
    check_parity(run_distributed(parity_results, 2, cases))


def test_hybrid_data_parallel_matches_single_process() -> None:
    """ddp=True at world size 4: 2 stages x 2 replicas, each replica on its own data; both placements."""
    cases = [
        ("mlp", {"partitions": 2, "microbatches": 4, "ddp": True, "placement_strategy": "cluster"}, {}),
        (
            "lm",
            {"partitions": 2, "microbatches": 4, "ddp": True, "pipeline": "simple", "placement_strategy": "spread"},
            {},
        ),
    ]
    check_parity(run_distributed(parity_results, 4, cases))


def test_hybrid_accumulation_without_overlap() -> None:
    """backward_passes_per_step=2 (gradients reduced every other step) with the all-reduce after backward."""
    cases = [("lm", {"partitions": 2, "microbatches": 2, "ddp": True}, {})]
    options = {"backward_passes_per_step": 2, "overlapping_allreduce": False, "bucket_cap_mb": 0.01}
    check_parity(run_distributed(parity_results, 4, cases, options))
