"""Pipeline schedules, and one ``@smp.step`` call executed as a sequence of per-micro-batch actions.

A stage's schedule is a list of actions: ``F k`` runs the user's step function on micro-batch ``k`` (its model
forward computes this stage's units; ``model.backward`` only records the request) and ``B k`` runs that
micro-batch's backward on this stage. In a schedule that also has ``W k`` actions, ``B k`` computes only the
gradients of the stage's inputs (sent upstream at once) and ``W k`` the parameters' gradients
(:mod:`~shardkit.modelparallel.pipeline.split_backward`). Four schedules, all starting with ``F 0`` on every stage:

- ``simple`` (GPipe): every forward, then every backward.
- ``interleaved`` (1F1B): a warm-up of ``num_stages - stage - 1`` forwards, a steady state alternating one
  forward and one backward, and a cool-down of the remaining backwards, so each backward runs as early as
  its gradients can exist and at most ``num_stages - stage`` micro-batches hold activations.
- ``zero_bubble`` (ZB-H1) and ``zero_bubble_h2`` (ZB-H2), Qi et al. 2024, arXiv 2401.10241 (shardkit
  additions to smp's two): each backward split into B and W, W's postponed to where the stage would wait.
  Both are :func:`split_backward_schedule` lists: a warm-up of ``n_s`` forwards (the micro-batches stage
  ``s`` holds before its first B), a steady state of "B, the W's now due, F", a cool-down of "B, the W's
  due", and the postponed W's at the end. ZB-H1 keeps 1F1B's ``n_s = p - s`` and lets every stage postpone
  W's until it holds ``max(2, p - 1)`` micro-batches (the first stage holds ``p`` under 1F1B already; the
  paper's bound, ``p`` everywhere, is :func:`zero_bubble_h1_schedule`'s ``hold``). With equal F, B and W
  times that leaves each stage idle ``(p-1)F`` at 2 stages and ``pF`` from 3, against 1F1B's
  ``(p-1)(F+B+W)`` (``(p-1)F`` at ``hold=p``). The later stages hold more micro-batches than under 1F1B,
  but less of each once B has run: on the bench LM the largest stage's peak activation stays within 1.05x
  of 1F1B's, which ``hold=p`` breaks at 4 stages
  (:func:`~shardkit.modelparallel.schedules.zb_schedules.zero_bubble_h1_hold` has the numbers). ZB-H2 starts with
  ``n_s = 2(p - s) - 1`` forwards (up to ``2p - 1`` micro-batches on the first stage) and reaches ``(p-1)F``.

Why none of them can deadlock. Only receives block (a send returns at once under gloo, and under NCCL it is
posted with the sender's next receive or right after B, see ``pp_communications``), and W neither sends nor
receives, so only the order of the F's and B's matters. Every stage runs its forwards and its backwards in
micro-batch order; the first stage never waits for an F, the last never for a B. Suppose every unfinished
stage waited forever. The highest one waits for an F (a B would come from a stage above it, unfinished and
so waiting too); following the F waits down to the first stage, which has none, gives a stage ``s`` waiting
for the gradient of ``B j`` while stage ``s + 1`` waits for the activation of an ``F k`` that ``s`` has not
run. In ``s``'s list ``B j`` follows ``F 0 .. F(n_s + j - 1)``, so ``k >= n_s + j``; ``s + 1`` is at ``F k``
and has not run ``B j``, so ``F k`` comes before ``B j`` in its list: ``k < n_(s+1) + j``. Both hold only if
``n_(s+1) > n_s``. So lists in which no stage runs more forwards before its first B than the stage before it
(``simple``: all of them; 1F1B: ``p - s``; ZB-H2: ``2(p - s) - 1``; all capped at ``m``) cannot deadlock,
whatever the action times. :func:`~shardkit.modelparallel.schedules.zb_schedules.simulate` checks this for many shapes
in the tests, and that a list breaking the condition does deadlock.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from shardkit.modelparallel.pipeline.execution import StageExecution
from shardkit.modelparallel.pipeline.runtime import MicrobatchRecord
from shardkit.modelparallel.pipeline.step_outputs import OutputSharing, share_from_output_stage
from shardkit.modelparallel.pipeline.virtual_stages import ChunkedStep, ProbeFinished, VirtualStageExecution
from shardkit.modelparallel.schedules.zb_schedules import zero_bubble_h1_hold


def _splits(execution: StageExecution) -> bool:
    """Whether ``execution``'s schedule splits each backward into B and W."""
    return any(a.kind == "W" for a in schedule_for(execution.pipeline, execution.stage, execution.num_stages, 1))


class Action(NamedTuple):
    """One unit of a stage's schedule: ``kind`` is ``"F"`` (forward), ``"B"`` (backward; its input half where
    the schedule has W actions) or ``"W"`` (the parameters' half of a split backward)."""

    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def simple_schedule(microbatches: int) -> list[Action]:
    """All forwards, then all backwards (GPipe)."""
    return [Action("F", k) for k in range(microbatches)] + [Action("B", k) for k in range(microbatches)]


def one_f_one_b_schedule(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """1F1B: warm-up forwards, then one forward / one backward, then the remaining backwards.

    Example::

        >>> one_f_one_b_schedule(0, 2, 3)
        [F0, F1, B0, F2, B1, B2]
    """
    warmup = min(num_stages - stage - 1, microbatches)
    actions = [Action("F", k) for k in range(warmup)]
    forward, backward = warmup, 0
    while forward < microbatches:  # steady state
        actions += [Action("F", forward), Action("B", backward)]
        forward += 1
        backward += 1
    actions += [Action("B", k) for k in range(backward, microbatches)]  # cool-down
    return actions


def zero_bubble_h1_schedule(stage: int, num_stages: int, microbatches: int, hold: Optional[int] = None) -> list[Action]:
    """ZB-H1: 1F1B's forwards and input-gradient backwards, each stage postponing W's while it holds fewer than
    ``hold`` micro-batches between F and W (default
    :func:`~shardkit.modelparallel.schedules.zb_schedules.zero_bubble_h1_hold`: ``p - 1``, at least 2).

    With equal F, B and W times each stage idles ``(2p - 1 - hold) F`` per step, from 1F1B's memory
    (``hold=1``: every stage runs each W right after its B) down to ``(p-1)F`` at ``hold=p``.

    Example::

        >>> zero_bubble_h1_schedule(1, 2, 4)
        [F0, B0, F1, B1, W0, F2, B2, W1, F3, B3, W2, W3]
        >>> zero_bubble_h1_schedule(1, 2, 4, hold=1)
        [F0, B0, W0, F1, B1, W1, F2, B2, W2, F3, B3, W3]
    """
    warmup = num_stages - stage
    hold = zero_bubble_h1_hold(num_stages) if hold is None else hold
    return split_backward_schedule(microbatches, warmup, max(0, hold - warmup))


def zero_bubble_h2_schedule(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """ZB-H2: ``2(p - s) - 1`` forwards before the first backward on stage ``s``, enough to fill the time
    until that backward's gradient arrives; stages with fewer than ``p`` postpone W's up to ``p`` in flight.

    Example::

        >>> zero_bubble_h2_schedule(0, 2, 4)
        [F0, F1, F2, B0, W0, F3, B1, W1, B2, W2, B3, W3]
    """
    warmup = 2 * (num_stages - stage) - 1
    return split_backward_schedule(microbatches, warmup, max(0, num_stages - warmup))


def split_backward_schedule(microbatches: int, warmup: int, postponed: int) -> list[Action]:
    """A stage's zero-bubble list: ``warmup`` forwards, then B / due W's / F, then B / due W's, then the rest.

    A W is due once more than ``postponed`` micro-batches have run B but not W, so the stage holds at most
    ``warmup + postponed`` micro-batches between F and W. The W's still postponed after the last B run once
    every gradient has gone upstream, while the stages before this one finish their cool-down.

    Example::

        >>> split_backward_schedule(4, 2, 1)
        [F0, F1, B0, F2, B1, W0, F3, B2, W1, B3, W2, W3]
    """
    warmup = min(warmup, microbatches)
    actions = [Action("F", k) for k in range(warmup)]
    forward, backward, weight = warmup, 0, 0

    def due() -> list[Action]:
        nonlocal weight
        start, weight = weight, max(weight, backward - postponed)
        return [Action("W", k) for k in range(start, weight)]

    while forward < microbatches:  # steady state
        actions.append(Action("B", backward))
        backward += 1
        actions += due()
        actions.append(Action("F", forward))
        forward += 1
    while backward < microbatches:  # cool-down
        actions.append(Action("B", backward))
        backward += 1
        actions += due()
    actions += [Action("W", k) for k in range(weight, microbatches)]  # the postponed W's
    return actions


def schedule_for(pipeline: str, stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """The actions of ``stage`` for the configured ``pipeline`` (``"simple"``, ``"interleaved"``,
    ``"zero_bubble"`` or ``"zero_bubble_h2"``)."""
    if pipeline == "simple":
        return simple_schedule(microbatches)
    if pipeline == "zero_bubble":
        return zero_bubble_h1_schedule(stage, num_stages, microbatches)
    if pipeline == "zero_bubble_h2":
        return zero_bubble_h2_schedule(stage, num_stages, microbatches)
    return one_f_one_b_schedule(stage, num_stages, microbatches)


@dataclass
class StepStats:
    """Timing of the last ``@smp.step`` on this rank."""

    #: Wall time of the whole step (forwards, backwards, gradient reduction).
    step_s: float = 0.0
    #: Time blocked on receiving activations or gradients: the bubble this stage saw.
    wait_s: float = 0.0
    #: Bytes this stage sent to the other stages (activations and gradients).
    sent_bytes: int = 0
    #: Time spent giving every stage the output stage's returned values (a broadcast over the stages).
    share_s: float = 0.0
    #: Seconds spent computing each kind of action (``"F"``, ``"B"``, ``"W"``), summed over the micro-batches,
    #: receive waits excluded (the first step's first forward, which partitions the model, is not counted).
    compute_s: dict[str, float] = field(default_factory=dict)
    #: Every action after the first forward: (``"F3"``, start, end, seconds of it blocked on receives), in
    #: ``time.perf_counter()`` seconds (one clock for every process of a machine, on Linux).
    trace: list[tuple[str, float, float, float]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """``wait_s / step_s``."""
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0


class StepRun:
    """One call of an ``@smp.step`` function: its micro-batches, run in this stage's schedule order.

    ``execution`` returns this rank's :class:`~shardkit.modelparallel.pipeline.execution.StageExecution`, or None
    before the partition: the first step's first forward builds it (the model partitions itself then), so
    the schedule asks again after that forward. ``current`` is the micro-batch whose forward is running.
    """

    def __init__(
        self,
        execution: Callable[[], Optional[StageExecution]],
        microbatches: int,
        forward: Callable[[int], Any],
        detach_outputs: bool = True,
        sharing: Optional[OutputSharing] = None,
    ) -> None:
        self.microbatches = microbatches
        self.detach_outputs = detach_outputs
        self.sharing = sharing if sharing is not None else OutputSharing()
        """What earlier calls of the same step function learned about its outputs."""
        self.stats = StepStats()
        """Timing of this step, filled in by :meth:`run`."""
        self._execution = execution
        self._forward_fn = forward
        self.records = [MicrobatchRecord(k) for k in range(microbatches)]
        self.current: Optional[MicrobatchRecord] = None

    def run(self) -> list[Any]:
        """Run every action; returns the step function's result per micro-batch (real on every stage)."""
        start = time.perf_counter()
        before = self._execution()
        if before is not None:
            before.begin_step()
        compute = dict.fromkeys("FBW", 0.0)
        # The first forward partitions the model on the first step: only then is the schedule known.
        began, waited = time.perf_counter(), before.link.wait_s if before is not None else 0.0
        chunked = isinstance(before, VirtualStageExecution)
        saving = before.saving(_splits(before)) if before is not None and not chunked else nullcontext()
        with saving, contextlib.suppress(ProbeFinished):  # virtual stages: that forward only learns the input shapes
            self._forward(0)
        if before is not None:
            compute["F"] += time.perf_counter() - began - (before.link.wait_s - waited)
        execution = self._execution()
        if execution is None:
            raise RuntimeError("the @smp.step function never called the DistributedModel, so it was not partitioned")
        if isinstance(execution, VirtualStageExecution):  # chunks on a tick grid: virtual_stages.py
            return self._finish(execution, execution.run_step(self), start)
        actions = schedule_for(execution.pipeline, execution.stage, execution.num_stages, self.microbatches)
        assert actions[0] == Action("F", 0)
        split = _splits(execution)
        grads_from = "W" if split else "B"  # the actions that produce parameter gradients
        last_backward = max((i for i, a in enumerate(actions) if a.kind == grads_from), default=-1)
        trace: list[tuple[str, float, float, float]] = []
        for i, action in enumerate(actions[1:], start=1):
            began, waited = time.perf_counter(), execution.link.wait_s
            if action.kind == "F":
                with execution.saving(split):
                    self._forward(action.microbatch)
            else:
                if i == last_backward:
                    execution.before_last_backward()
                self._backward(execution, action, split)
            ended, blocked = time.perf_counter(), execution.link.wait_s - waited
            compute[action.kind] += ended - began - blocked
            trace.append((repr(action), began, ended, blocked))
        execution.finish_step(any(r.backward_requested for r in self.records))
        shared_at = time.perf_counter()
        outputs = self._share_outputs(execution, [r.outputs for r in self.records])
        end = time.perf_counter()
        link = execution.link
        self.stats = StepStats(end - start, link.wait_s, link.sent_bytes, end - shared_at, compute, trace)
        return outputs

    def _finish(self, execution: StageExecution, step: ChunkedStep, start: float) -> list[Any]:
        shared_at = time.perf_counter()
        outputs = self._share_outputs(execution, step.outputs)
        end = time.perf_counter()
        link = execution.link
        self.stats = StepStats(end - start, link.wait_s, link.sent_bytes, end - shared_at, step.compute, step.trace)
        return outputs

    def _backward(self, execution: StageExecution, action: Action, split: bool) -> None:
        record = self.records[action.microbatch]
        if record.backward_requested:
            kind = action.kind if split else "BW"
            execution.run_backward(kind, record, self.microbatches, self.detach_outputs)

    def _forward(self, microbatch: int) -> None:
        self.forward_into(self.records[microbatch])

    def forward_into(self, record: MicrobatchRecord) -> None:
        """Run the step function on micro-batch ``record.index``; the model's calls record into ``record``."""
        self.current = record
        try:
            record.outputs = self._forward_fn(record.index)
        finally:
            self.current = None

    def _share_outputs(self, execution: StageExecution, outputs: list[Any]) -> list[Any]:
        """Replace every returned value by the output stage's: only there is the loss real."""
        return share_from_output_stage(
            outputs,
            execution.output_stage,
            execution.mp_group,
            execution.num_stages,
            execution.device,
            self.detach_outputs,
            self.sharing,
        )
