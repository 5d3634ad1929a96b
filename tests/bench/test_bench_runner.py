"""Merging per-rank measurements into the numbers the tables print."""

import math

from shardkit.memory.meter import MemoryBreakdown
from shardkit.strategies.live import StrategyResult, combine, paired_ratio


def test_combine_takes_slowest_rank_mean_loss_and_largest_memory() -> None:
    rank0 = StrategyResult(
        "x", [1.0, 3.0, 2.0], {"forward": [0.5, 2.0, 1.0]}, [4.0, 2.0], MemoryBreakdown(10, 5, 20), 7, 100
    )
    rank1 = StrategyResult(
        "x", [2.0, 1.0, 2.5], {"forward": [1.0, 0.5, 2.0]}, [2.0, 1.0], MemoryBreakdown(10, 6, 10), 9, 100
    )
    merged = combine([rank0, rank1])
    assert merged.step_times == [2.0, 3.0, 2.5]
    assert merged.median_step_s == 2.5 and merged.min_step_s == 2.0
    assert merged.phase_medians_s == {"forward": 2.0}  # per step max: 1.0, 2.0, 2.0
    assert merged.losses == [3.0, 1.5]
    assert merged.memory == MemoryBreakdown(10, 5, 20)  # total 35 > 26
    assert merged.comm_bytes_per_step == 9 + 100 and merged.comm_source == "measured+formula"
    assert merged.error is None


def test_comm_source_and_errors() -> None:
    formula_only = combine([StrategyResult("a", formula_bytes_per_step=5)])
    assert (formula_only.comm_source, formula_only.comm_bytes_per_step) == ("formula", 5)
    assert combine([StrategyResult("b", meter_bytes_per_step=3)]).comm_source == "measured"
    failed = combine(
        [StrategyResult("c", error="RuntimeError: failed on another rank"), StrategyResult("c", error="KeyError: 1")]
    )
    assert failed.error == "KeyError: 1"  # the rank that actually failed, not the one told about it
    assert math.isnan(failed.median_step_s)


def test_paired_ratio_cancels_drifting_load() -> None:
    base = [1.0, 2.0, 4.0, 8.0]  # the machine gets busier step by step
    assert paired_ratio([0.9, 1.8, 3.6, 7.2], base) == 0.9
    assert math.isnan(paired_ratio([1.0], base))
