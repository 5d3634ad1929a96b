"""The smp side of ``shardkit bench pipeline``: one partitioned model stepped under several schedules.

smp allows one ``DistributedModel`` per process, so the schedules share it: each keeps its own copy of this
stage's parameters and optimizer state, swapped in (outside the timed region) before its step, so every
schedule trains from the same start on the same batches as if it ran alone, and their losses can be compared.

Activation memory is measured by the stage's own saved-tensor slots
(:class:`~shardkit.modelparallel.pipeline.saved_activations.SavedActivations`, turned on for every schedule during one
extra step): the bytes of the tensors autograd keeps for backward (parameters excluded, each storage counted
once) plus, under a split backward, the gradients kept for W, live at the same time on this stage, at their
peak over the step. It is what a schedule's order decides (how many micro-batches hold their activations at
once, and what a split backward still holds between B and W), independent of the allocator and the device.

Each step also records how long this stage computed its F, B and W actions (receive waits excluded):
:func:`predicted_bubble` replays the schedule with those times in the simulator the zero-bubble lists are
built with, which separates what the schedule leaves idle from what the stages' unequal costs do.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Callable

import torch

import shardkit.modelparallel as smp
from shardkit.modelparallel.pipeline.pipeline_parallel import schedule_for
from shardkit.modelparallel.schedules.zb_schedules import simulate
from shardkit.models import TransformerLM


class SmpSchedules:
    """The smp pipeline over the bench LM (auto-partitioned), steppable under each of ``schedules``."""

    def __init__(self, settings: Any, schedules: list[str], build_lm: Callable[[], TransformerLM]) -> None:
        smp.init(
            {
                "partitions": settings.stages,
                "microbatches": settings.microbatches,
                "pipeline": schedules[0],
                "optimize": settings.smp_optimize,
                "virtual_stages": settings.virtual_stages,
            }
        )
        self.smp = smp
        self.schedules = schedules
        self.model = smp.DistributedModel(build_lm(), trace_device="cpu")
        self.optimizer = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=settings.lr))
        self.waits: dict[str, list[float]] = {s: [] for s in schedules}
        self.shares: dict[str, list[float]] = {s: [] for s in schedules}
        #: Bytes this stage sent to the others per step (activations and gradients: ``StepStats.sent_bytes``).
        self.sent: dict[str, list[int]] = {s: [] for s in schedules}
        self.costs: dict[str, list[dict[str, float]]] = {s: [] for s in schedules}
        #: Each schedule's last timed step, action by action (``StepStats.trace``), for --json.
        self.traces: dict[str, list[tuple[str, float, float, float]]] = {}
        self._saved: dict[str, Any] = {}
        self._current = schedules[0]

        @smp.step
        def train_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
            loss = TransformerLM.loss_fn(model(tokens), targets)
            model.backward(loss)
            return (loss, loss.item()) if settings.smp_item_outputs else (loss,)

        @smp.step
        def forward_only(model: Any, tokens: torch.Tensor) -> None:
            model(tokens)

        self.train_step = train_step
        self.forward_only = forward_only

    def partition(self, tokens: torch.Tensor) -> None:
        """A forward-only step: partitions the model without changing it; every schedule starts from here."""
        with torch.no_grad():
            self.forward_only(self.model, tokens)
        for schedule in self.schedules:
            self._saved[schedule] = self._snapshot()

    def use(self, schedule: str) -> None:
        """Make ``schedule``'s weights and optimizer state current (not timed)."""
        if schedule == self._current:
            return
        self._saved[self._current] = self._snapshot()
        params, states = self._saved[schedule]
        with torch.no_grad():
            for p, saved in zip(self.model.local_parameters(), params):
                p.copy_(saved)
        for p, state in zip(self.model.local_parameters(), states):
            self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        execution = self.model.stage_execution
        assert execution is not None
        execution.pipeline = schedule
        self._current = schedule

    def _snapshot(self) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        params = list(self.model.local_parameters())
        states = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state.get(p, {}).items()}
            for p in params
        ]
        return [p.detach().clone() for p in params], states

    def step(self, schedule: str, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step under ``schedule`` (call :meth:`use` first); returns the mean loss."""
        self.optimizer.zero_grad()
        loss = self.train_step(self.model, tokens, targets)[0].reduce_mean().item()
        self.optimizer.step()
        self.waits[schedule].append(self.model.last_step_stats.bubble_fraction)
        self.shares[schedule].append(self.model.last_step_stats.share_s)
        self.sent[schedule].append(self.model.last_step_stats.sent_bytes)
        self.costs[schedule].append(dict(self.model.last_step_stats.compute_s))
        self.traces[schedule] = list(self.model.last_step_stats.trace)
        return float(loss)

    def peak_activation_bytes(self, schedule: str, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
        """One more (untimed) step under ``schedule``: this stage's peak bytes saved for backward, and its peak
        of those and the gradients kept for W together."""
        self.use(schedule)
        execution = self.model.stage_execution
        assert execution is not None
        execution.measure_activations = True
        execution.activations.reset_peak()
        timed_trace = self.traces.get(schedule, [])
        try:
            self.step(schedule, tokens, targets)
        finally:
            execution.measure_activations = False
        for series in (self.waits, self.shares, self.costs, self.sent):
            series[schedule].pop()
        self.traces[schedule] = timed_trace
        return execution.activations.saved.peak, execution.activations.total.peak


def action_costs(per_step: Sequence[dict[str, float]], microbatches: int) -> dict[str, float]:
    """Median seconds of one F, B and W action over ``per_step`` (each step's sums; unsplit: W is 0), per
    micro-batch of the step; and ``"B+W"``, the backwards a V schedule ran whole, where it ran any."""
    kinds = ["F", "B", "W"] + (["B+W"] if any("B+W" in step for step in per_step) else [])
    return {kind: statistics.median(step.get(kind, 0.0) for step in per_step) / microbatches for kind in kinds}


def bubble_floor(costs: Sequence[dict[str, float]], microbatches: int) -> float:
    """The least mean idle fraction any order of these per-stage action times allows (``costs[s]``: seconds of
    one F, B and W on stage ``s``).

    Stage ``s`` can start nothing before the first micro-batch's forward has passed every stage ahead of it, and
    then has ``m (F + B + W)`` of its own to do, so no step is shorter than the largest
    ``F_0 + ... + F_{s-1} + m (F_s + B_s + W_s)``; the stages cannot be busier than their work over ``p`` such
    steps. With equal times at 2 stages this is ZB-H1's idle time (``F`` on each stage): what is left above it
    in a measured bubble is the schedule's (or the run's), what is below it no schedule can remove.
    """
    work = [microbatches * sum(c.get(kind, 0.0) for kind in "FBW") for c in costs]
    step = max(sum(c["F"] for c in costs[:s]) + work[s] for s in range(len(costs)))
    return 1.0 - sum(work) / (len(costs) * step) if step > 0 else 0.0


def predicted_bubble(schedule: str, costs: Sequence[dict[str, float]], microbatches: int) -> float:
    """The mean idle fraction of ``schedule``'s lists run with each stage's measured action ``costs``."""
    stages = len(costs)
    lists = [schedule_for(schedule, s, stages, microbatches) for s in range(stages)]
    return simulate(lists, costs).mean_bubble()
