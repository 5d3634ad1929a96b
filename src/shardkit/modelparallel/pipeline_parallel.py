"""Pipeline schedules, and one ``@smp.step`` call executed as a sequence of per-micro-batch actions.

A stage's schedule is a list of actions: ``F k`` runs the user's step function on micro-batch ``k`` (its model
forward computes this stage's units; ``model.backward`` only records the request) and ``B k`` runs that
micro-batch's backward on this stage. Two schedules, both starting with ``F 0`` on every stage:

- ``simple`` (GPipe): every forward, then every backward.
- ``interleaved`` (1F1B): a warm-up of ``num_stages - stage - 1`` forwards, a steady state alternating one
  forward and one backward, and a cool-down of the remaining backwards, so each backward runs as early as
  its gradients can exist and at most ``num_stages - stage`` micro-batches hold activations.

Activations only flow to higher stages and gradients to lower ones, and every stage runs its forwards and its
backwards in micro-batch order, so each blocking receive waits on work the sender's schedule puts before
anything that could wait on the receiver: neither schedule can deadlock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardkit.modelparallel.pp_communications import broadcast_tensors
from shardkit.modelparallel.runtime import MicrobatchRecord

if TYPE_CHECKING:
    from shardkit.modelparallel.model import DistributedModel


class Action(NamedTuple):
    """One unit of a stage's schedule: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

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


def schedule_for(pipeline: str, stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """The actions of ``stage`` for the configured ``pipeline`` (``"simple"`` or ``"interleaved"``)."""
    if pipeline == "simple":
        return simple_schedule(microbatches)
    return one_f_one_b_schedule(stage, num_stages, microbatches)


@dataclass
class StepStats:
    """Timing of the last ``@smp.step`` on this rank."""

    step_s: float = 0.0
    """Wall time of the whole step (forwards, backwards, gradient reduction)."""
    wait_s: float = 0.0
    """Time blocked on receiving activations or gradients: the bubble this stage saw."""
    sent_bytes: int = 0

    @property
    def bubble_fraction(self) -> float:
        """``wait_s / step_s``."""
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0


class StepRun:
    """One call of an ``@smp.step`` function: its micro-batches, run in this stage's schedule order."""

    def __init__(
        self, model: DistributedModel, microbatches: int, forward: Callable[[int], Any], detach_outputs: bool = True
    ) -> None:
        self.model = model
        self.microbatches = microbatches
        self.detach_outputs = detach_outputs
        self._forward_fn = forward
        self.records = [MicrobatchRecord(k) for k in range(microbatches)]
        self.current: Optional[MicrobatchRecord] = None

    def run(self) -> list[Any]:
        """Run every action; returns the step function's result per micro-batch (real on every stage)."""
        start = time.perf_counter()
        model = self.model
        model._before_step()
        if model.partitioned:
            model._link().reset_stats()
        self._forward(0)  # the first forward partitions the model on the first step
        link = model._link()
        actions = schedule_for(model._pipeline_kind(), model._stage(), model._num_stages(), self.microbatches)
        assert actions[0] == Action("F", 0)
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        for i, action in enumerate(actions[1:], start=1):
            if action.kind == "F":
                self._forward(action.microbatch)
            else:
                if i == last_backward:
                    model._before_last_backward()
                self._backward(action.microbatch)
        link.wait_sends()
        model._after_backward(any(r.backward_requested for r in self.records))
        outputs = self._share_outputs([r.outputs for r in self.records])
        model.last_step_stats = StepStats(time.perf_counter() - start, link.wait_s, link.sent_bytes)
        return outputs

    def _forward(self, microbatch: int) -> None:
        record = self.records[microbatch]
        self.current = record
        try:
            record.outputs = self._forward_fn(microbatch)
        finally:
            self.current = None

    def _backward(self, microbatch: int) -> None:
        record = self.records[microbatch]
        if not record.backward_requested:
            return
        scale = 1.0 / self.microbatches if self.model.options.average_grads_across_microbatches else 1.0
        self.model._runtime_or_fail().backward(record, scale)

    def _share_outputs(self, outputs: list[Any]) -> list[Any]:
        """Replace every returned tensor by the output stage's value: only there is the loss real."""
        model = self.model
        leaves, spec = tree_flatten(outputs)
        leaves = [x.detach() if self.detach_outputs and isinstance(x, torch.Tensor) else x for x in leaves]
        if model._num_stages() == 1:
            return tree_unflatten(leaves, spec)
        index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        shared = broadcast_tensors(
            [leaves[i] for i in index], model._output_stage(), model._mp_group(), label="step_outputs"
        )
        for i, tensor in zip(index, shared):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)
