"""One stage's share of a partitioned model, as the pipeline schedule drives it.

:class:`StageExecution` is built when the partition plan is applied (the first ``@smp.step``) and handed to
every later step's schedule (:class:`~shardkit.modelparallel.pipeline.pipeline_parallel.StepRun`). It bundles what
running the stage takes: the forward dispatch (:class:`~shardkit.modelparallel.pipeline.runtime.StageRuntime`), the
link to the other stages, the gradient reduction across replicas and the buffer broadcast, so the schedule
needs no model class and the model exposes no internals to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Union

import torch

from shardkit.distributed import GroupLike
from shardkit.distributed import collectives as C
from shardkit.modelparallel.pipeline.grad_sync import GradientSync
from shardkit.modelparallel.pipeline.pp_communications import StageLink
from shardkit.modelparallel.pipeline.runtime import MicrobatchRecord, StageRuntime
from shardkit.modelparallel.pipeline.saved_activations import SavedActivations
from shardkit.modelparallel.sdp.sync import ShardedGradientSync


class StageExecution:
    """This rank's stage of the partitioned model: what a step's schedule calls, in schedule order.

    ``pipeline`` is the configured schedule (a name in ``config.PIPELINES``), ``mp_group``
    joins the replica's stages (step outputs are broadcast from the output stage over it), ``average_grads``
    divides each micro-batch's loss gradient by the number of micro-batches, and ``buffers`` lists the
    buffers this stage holds, broadcast from the first replica before every step when ``broadcast_buffers`` is set.
    """

    def __init__(
        self,
        runtime: StageRuntime,
        sync: Union[GradientSync, ShardedGradientSync],
        *,
        pipeline: str,
        num_stages: int,
        mp_group: GroupLike,
        dp_group: GroupLike,
        average_grads: bool,
        broadcast_buffers: bool,
        buffers: Callable[[], Iterable[torch.Tensor]],
        joining: bool = False,
        checkpointed: tuple[str, ...] = (),
    ) -> None:
        self.runtime = runtime
        self.sync = sync
        """Gradient reduction across replicas (and across stages holding tied copies)."""
        self.pipeline = pipeline
        self.num_stages = num_stages
        self.mp_group = mp_group
        self.average_grads = average_grads
        self.joining = joining
        """True inside ``DistributedModel.join()``: each step first tells the other replicas it still trains."""
        self.checkpointed = checkpointed
        """Activation-checkpointed modules on this stage: its backward is never split (W would recompute them)."""
        self.unsplit_reason: Optional[str] = None
        """Why this stage's backward ran unsplit under a zero-bubble schedule (None while it splits)."""
        self.activations = SavedActivations()
        """This stage's saved tensors, in slots a split backward empties after B (and their bytes)."""
        self.measure_activations = False
        """Count saved tensors under every schedule, not only split ones (the benchmark's memory step)."""
        self.sharded: Optional[Any] = None
        """Under sharded data parallelism, the stage's sharded module (an ``sdp.wrap.ShardedStage``), else None."""
        self._dp_group = dp_group
        self._broadcast_buffers = broadcast_buffers
        self._buffers = buffers

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.runtime.stage

    @property
    def output_stage(self) -> int:
        """The stage where the model's outputs (and so the loss) are real."""
        return self.runtime.plan.output_stage

    @property
    def device(self) -> torch.device:
        """The device this stage computes on (where it allocates what it receives)."""
        return self.runtime.device

    @property
    def link(self) -> StageLink:
        """Point-to-point sends and receives between this replica's stages (and their statistics)."""
        return self.runtime.link

    # ---- the step's life cycle, in the order the schedule calls it ------------------------------------------

    def saving(self, split: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch's forward runs under: saved-tensor slots where the backward is split
        (so B can free what W does not need) or activations are measured; otherwise nothing."""
        return self.activations.hooks() if split or self.measure_activations else nullcontext()

    def begin_step(self) -> None:
        """Before a step's first forward: the join handshake (inside ``join()``) and the buffer broadcast."""
        if self.joining:
            self.sync.joining = True
            self.sync.join_flag(1)  # tells replicas that ran out of data: one more step
        self.broadcast_buffers()
        self.link.reset_stats()

    def broadcast_buffers(self) -> None:
        """Every replica takes the first replica's buffers (``broadcast_buffers=True`` with several replicas)."""
        if self._broadcast_buffers:
            for buf in self._buffers():
                C.broadcast(buf.data, 0, group=self._dp_group, label="smp_ddp_buffers")

    def before_last_backward(self) -> None:
        """Arm the gradient reduction: the next backward (W, in a split schedule) is this step's last one to
        produce parameter gradients on this stage."""
        self.sync.arm()

    def backward(self, record: MicrobatchRecord, microbatches: int) -> None:
        """Backward of one micro-batch on this stage (the loss gradient scaled per ``average_grads``)."""
        scale = 1.0 / microbatches if self.average_grads else 1.0
        if self.sharded is not None:  # a stage's backward may start from what it sent, not from its outputs
            self.sharded.hook_backward_roots(t for t, _ in record.sent)
        self.runtime.backward(record, scale)

    def backward_input(self, record: MicrobatchRecord, microbatches: int) -> None:
        """B of a split backward (zero-bubble schedules): input gradients now, parameter gradients at W.

        Where the backward cannot be split, it runs whole here (W is then empty) and a warning says why, once.
        """
        scale = 1.0 / microbatches if self.average_grads else 1.0
        reason = self.runtime.backward_input(record, scale, split=not self.checkpointed, saved=self.activations)
        if reason is not None and self.unsplit_reason is None:
            if self.checkpointed:
                reason = f"activation-checkpointed modules {list(self.checkpointed)} run on this stage"
            self.unsplit_reason = reason
            warnings.warn(
                f"pipeline {self.pipeline!r}: stage {self.stage} runs its backward unsplit ({reason}); training is "
                "the same, but this stage's weight gradients no longer fill the pipeline's bubble",
                stacklevel=2,
            )

    def backward_weight(self, record: MicrobatchRecord) -> None:
        """W of a split backward: the parameter gradients B left for later (their ``.grad`` hooks fire here)."""
        self.runtime.backward_weight(record)

    def run_backward(self, kind: str, record: MicrobatchRecord, microbatches: int, detach_outputs: bool) -> None:
        """One backward action of a schedule: ``"W"`` (:meth:`backward_weight`), ``"B"`` (:meth:`backward_input`,
        then the step's returned tensors detached where ``detach_outputs``: the returned loss would otherwise
        hold every micro-batch's graph until the step's end), or any other kind: the whole backward."""
        if kind == "W":
            self.backward_weight(record)
        elif kind == "B":
            self.backward_input(record, microbatches)
            if detach_outputs:
                record.detach_outputs()
        else:
            self.backward(record, microbatches)

    def finish_step(self, had_backward: bool) -> None:
        """After the last backward: wait for sends, then complete the gradient reduction."""
        self.link.wait_sends()
        self.sync.finish(had_backward)

    def close(self) -> None:
        """Give the wrapped modules back and stop the gradient reduction (``smp.reset``)."""
        self.runtime.uninstall()
        self.sync.close()
