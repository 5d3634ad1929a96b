"""Pipelined training with smp equals single-process training: losses and final parameters, within 1e-5.

Every configuration of a world size runs in one multi-process job (``smp.reset`` between them) to keep the
suite fast.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
from smp_testlib import reference_run, smp_run

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff

TOL = 1e-5
STEPS = 3
BATCH = 8


Case = tuple[str, dict[str, Any], dict[str, Any]]


def _parity(rank: int, world_size: int, cases: list[Case], options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    results = {}
    options = options or {}
    steps = STEPS * options.get("backward_passes_per_step", 1)
    for name, config, model_kwargs in cases:
        replicas = world_size // config["partitions"]
        ref_losses, ref_state = reference_run(name, steps, BATCH, replicas, options.get("backward_passes_per_step", 1))
        losses, state, model = smp_run(name, config, steps, BATCH, model_kwargs, **options)
        key = f"{name}-{config}-{options}"
        results[key] = {
            "loss_diff": max(abs(a - b[smp.dp_rank()]) for a, b in zip(losses, ref_losses)),
            "param_diff": max_state_diff(state, ref_state),
            "trained": max_state_diff(ref_state, reference_run(name, 0, BATCH)[1]),
            "local": sum(p.numel() for p in model.local_parameters()),
            "total": sum(v.numel() for v in ref_state.values()),
        }
        smp.reset()
    return results


def _schedules(partitions: int, name: str = "mlp") -> list[Case]:
    return [
        (name, {"partitions": partitions, "microbatches": mb, "pipeline": pipeline}, {})
        for pipeline in ("simple", "interleaved")
        for mb in (1, 4, 8)
    ]


def _check(results: list[dict[str, Any]], split: bool = True) -> None:
    for per_rank in results:
        for key, r in per_rank.items():
            assert r["loss_diff"] <= TOL, f"{key}: losses differ from single-process training by {r['loss_diff']}"
            assert r["param_diff"] <= TOL, f"{key}: parameters differ from single-process training by {r['param_diff']}"
            assert r["trained"] > 1e-3, f"{key}: training did not change the reference parameters"
            if split:
                assert r["local"] < r["total"], f"{key}: a stage holds every parameter, nothing was split"


@pytest.mark.parametrize("partitions", [2, 4])
def test_pipeline_matches_single_process(partitions: int) -> None:
    """Both schedules with 1, 4 and 8 micro-batches, 2 and 4 stages, on an MLP split automatically."""
    _check(run_distributed(_parity, partitions, _schedules(partitions)))


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
    _check(run_distributed(_parity, 4, cases))


def test_two_stage_residual_and_lm() -> None:
    cases = [
        ("residual", {"partitions": 2, "microbatches": 4, "auto_partition": False}, {"stages": 2}),
        ("lm", {"partitions": 2, "microbatches": 8, "pipeline": "simple"}, {}),
        ("lm", {"partitions": 2, "microbatches": 4}, {}),
    ]
    _check(run_distributed(_parity, 2, cases))


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
    _check(run_distributed(_parity, 4, cases))


def test_hybrid_accumulation_without_overlap() -> None:
    """backward_passes_per_step=2 (gradients reduced every other step) with the all-reduce after backward."""
    cases = [("lm", {"partitions": 2, "microbatches": 2, "ddp": True}, {})]
    options = {"backward_passes_per_step": 2, "overlapping_allreduce": False, "bucket_cap_mb": 0.01}
    _check(run_distributed(_parity, 4, cases, options))
