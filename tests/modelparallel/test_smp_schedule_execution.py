"""The schedule drives an explicit stage-execution object: no model class, calls in the order the step needs."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import shardkit.modelparallel.pipeline.pipeline_parallel as pipeline_parallel
from shardkit.distributed import DummyProcessGroup
from shardkit.modelparallel.pipeline.pipeline_parallel import StepRun
from shardkit.modelparallel.pipeline.runtime import MicrobatchRecord


class _Link:
    wait_s = 0.25
    sent_bytes = 64


class _FakeExecution:
    """Stands in for StageExecution: records what the schedule asks of it."""

    def __init__(self, pipeline: str, stage: int, num_stages: int) -> None:
        self.pipeline, self.stage, self.num_stages = pipeline, stage, num_stages
        self.output_stage = num_stages - 1
        self.mp_group = DummyProcessGroup(rank=stage, size=num_stages)  # one process: no traffic
        self.device = torch.device("cpu")
        self.link = _Link()
        self.calls: list[str] = []

    def begin_step(self) -> None:
        self.calls.append("begin")

    def before_last_backward(self) -> None:
        self.calls.append("arm")

    def saving(self, split: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, record: MicrobatchRecord, microbatches: int) -> None:
        self.calls.append(f"B{record.index}/{microbatches}")

    def run_backward(self, kind: str, record: MicrobatchRecord, microbatches: int, detach_outputs: bool) -> None:
        assert kind not in ("B", "W"), kind  # these schedules never split a backward
        self.backward(record, microbatches)

    def finish_step(self, had_backward: bool) -> None:
        self.calls.append(f"finish:{had_backward}")


def _run(execution: _FakeExecution, microbatches: int, built_by_first_forward: bool) -> StepRun:
    holder: dict[str, Optional[_FakeExecution]] = {"e": None if built_by_first_forward else execution}
    run: StepRun

    def forward(mb: int) -> Any:
        assert run.current is not None and run.current.index == mb
        holder["e"] = execution  # the first forward partitions: the execution exists from then on
        execution.calls.append(f"F{mb}")
        run.current.backward_requested = True
        return mb * 10

    run = StepRun(lambda: holder["e"], microbatches, forward)  # type: ignore[arg-type,return-value]
    assert run.run() == [mb * 10 for mb in range(microbatches)]
    return run


def test_one_f_one_b_drives_the_execution_in_order() -> None:
    execution = _FakeExecution("interleaved", stage=0, num_stages=2)
    run = _run(execution, 3, built_by_first_forward=False)
    assert execution.calls == ["begin", "F0", "F1", "B0/3", "F2", "B1/3", "arm", "B2/3", "finish:True"]
    assert run.stats.wait_s == 0.25 and run.stats.sent_bytes == 64 and run.stats.step_s > 0


def test_first_step_begins_only_once_the_stage_exists() -> None:
    execution = _FakeExecution("simple", stage=0, num_stages=1)
    _run(execution, 2, built_by_first_forward=True)
    assert execution.calls == ["F0", "F1", "B0/2", "arm", "B1/2", "finish:True"]


def test_a_step_that_never_calls_the_model_says_so() -> None:
    run = StepRun(lambda: None, 1, lambda mb: None)
    with pytest.raises(RuntimeError, match="never called the DistributedModel"):
        run.run()


def test_schedule_module_imports_no_model_class() -> None:
    tree = ast.parse(Path(pipeline_parallel.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m and (m.endswith(".model") or m.endswith(".holding") or m.endswith(".build"))}
