"""The training lifecycle of wrapped units: pre_forward, post_forward, pre_backward, post_backward and the root's
end-of-backward callback, driven by one explicit state machine.

Per step, for each unit: ``pre_forward`` gathers the full parameters (and, with ``forward_prefetch``, starts
gathering the next unit's) and exposes them as views; ``post_forward`` frees them (unless backward needs them
right away) and hooks the outputs, so that ``pre_backward`` gathers them again before the unit's gradients are
computed (``BACKWARD_PRE`` also starts the next unit's gather there); ``post_backward`` fires once per flat
parameter when autograd has accumulated its full gradient, starts its reduce-scatter and frees the full copy
(``BACKWARD_POST`` prefetches once the unit's last gradient is out). The root queues ``finish_backward`` with
autograd's engine; it waits for the last reductions, frees whatever is still gathered and returns every unit
to IDLE. The root's :class:`~shardkit.nn.fsdp.prefetch.Schedule` records the order and rate-limits prefetches;
its :class:`~shardkit.nn.fsdp.reduce.ReduceQueue` holds the reductions in flight.

The state machine itself (:class:`TrainingState`, which event may start from which state) is
:mod:`shardkit.nn.fsdp.unit_state`; the input casters are :mod:`shardkit.nn.fsdp.input_cast` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function

from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import BackwardPrefetch, FSDPPolicies
from shardkit.nn.fsdp.prefetch import Schedule
from shardkit.nn.fsdp.reduce import ReduceQueue
from shardkit.nn.fsdp.unit_state import IN_BACKWARD, TrainingState, check_event, may_start, state_hint
from shardkit.utils._torch_private import queue_autograd_callback, tree_flatten, tree_unflatten
from shardkit.utils.autograd import backward_running, weak_method_hook

__all__ = ["EAGER_REASON", "TrainingState", "Unit", "eager"]

#: Why the lifecycle hooks run eagerly under ``torch.compile`` (shown by ``fullgraph=True``'s error).
EAGER_REASON = (
    "FullyShardedDataParallel runs its gather/free hooks eagerly (they resize storages and issue collectives); "
    "compile with fullgraph=False (the module's compute between the hooks is compiled), or compile the blocks "
    "inside before wrapping them: FSDP(torch.compile(block))"
)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``fn`` out of dynamo's graphs: it runs as plain Python under ``torch.compile`` (a graph break)."""
    return torch.compiler.disable(fn, reason=EAGER_REASON)


class Unit:
    """Run-time state of one wrapped unit (the module-state layer above :class:`ParamGroup`)."""

    def __init__(self, group: ParamGroup, policies: FSDPPolicies, module_name: str) -> None:
        self.group = group
        self.policies = policies
        #: Readable name for errors: the path from the root, set at lazy init (class name before).
        self.name = module_name
        self.state = TrainingState.IDLE
        self._resume_state: list[TrainingState] = []
        #: None until the first forward decides; True for the outermost unit of a tree.
        self.is_root: Optional[bool] = None
        self.root: Optional[Unit] = None
        #: Root only: every unit of the tree in pre-order (itself first).
        self.units: list[Unit] = []
        #: False inside ``no_sync()``: gradients are accumulated unsharded instead of reduce-scattered.
        self.sync_grads = True
        self._callback_queued = False
        self.cast_inputs: Callable[[Any], Any] = lambda x: x
        #: Root only: execution order and prefetches; reductions in flight; channels and streams.
        self.schedule: Schedule[Unit] = Schedule()
        self.reduces = ReduceQueue()
        self.comm = CommContext()
        #: Gradients of this unit's trainable flat parameters already out in this backward.
        self._grads_done = 0
        #: Forwards whose inputs still wait for their gradient (frozen parameters are needed until then).
        self._inputs_pending = 0
        #: Inside a forward that nobody undoes if it raises (see :meth:`pre_forward`).
        self._unguarded = False
        for handle in group.handles:
            handle.on_grad_ready = self.post_backward

    def join_tree(self, root: Unit, name: str) -> None:
        """Become a nested unit of ``root``'s tree under ``name`` (its path from the root), at the root's lazy init."""
        self.is_root, self.root, self.units, self.name = False, root, [], name

    def leave_tree(self) -> None:
        """Forget the tree the root's lazy init decided (fairscale's ``_reset_lazy_init``): the next forward of
        the outermost unit decides again, e.g. after this unit was wrapped into a bigger model. Only between
        steps; new process groups for the reductions are created at that forward (on every rank)."""
        self.assert_state(TrainingState.IDLE)
        self.is_root, self.root, self.units = None, None, []
        self.schedule = Schedule()
        self.comm = CommContext()

    @property
    def tree_schedule(self) -> Schedule[Unit]:
        """The schedule of this unit's tree (the root's)."""
        return (self.root or self).schedule

    @property
    def tree_reduces(self) -> ReduceQueue:
        """The reductions in flight of this unit's tree (the root's queue)."""
        return (self.root or self).reduces

    @property
    def ctx(self) -> CommContext:
        """Where this unit's tree communicates (the root's context)."""
        return (self.root or self).comm

    def transition(self, event: str) -> None:
        """Apply ``event`` or raise an error naming this unit, its state and what to do."""
        target = check_event(self.name, self.state, event)
        if event == "pre_forward":
            self._resume_state.append(self.state)
            self.state = TrainingState.FORWARD
        elif event == "post_forward":
            self.state = self._resume_state.pop()
        elif event == "abandon":
            self._resume_state.clear()
            self.state = TrainingState.IDLE
        elif target is not None:
            self.state = target

    # ------------------------------------------------------------------ settings that change between steps
    def divide_factors(self) -> tuple[float, float]:
        """What gradients are divided by before and after their reduction (``gradient_predivide_factor``)."""
        world_size = self.group.dp_size
        chosen = self.policies.reduce.divide_factors(world_size)
        if chosen is not None:
            return chosen
        # shardkit's own choice (shardkit.nn.fsdp.reduce): 16-bit sums are divided first, FP32 ones after.
        mp = self.policies.mixed_precision
        dtypes = {mp.reduce_dtype or h.compute_dtype for h in self.group.handles}
        if dtypes - {torch.float32}:
            return float(world_size), 1.0
        return 1.0, float(world_size)

    def set_divide_factors(self, pre: float, post: float) -> None:
        """Divide gradients by ``pre`` before the reduction and ``post`` after it from now on (between steps)."""
        reduce = dataclasses.replace(self.policies.reduce, predivide_factor=pre, postdivide_factor=post)
        # The frozen policies are replaced whole; the parameter group reads the same object.
        self.policies = dataclasses.replace(self.policies, reduce=reduce)
        self.group.policies = self.policies

    def assert_state(self, *states: TrainingState) -> None:
        if self.state not in states:
            wanted = " or ".join(s.name for s in states)
            raise RuntimeError(
                f"unit '{self.name}' is in state {self.state.name}, expected {wanted}: {state_hint(self.state)}"
            )

    # ------------------------------------------------------------------ forward
    def forward_inside_summon(self) -> bool:
        """True when a forward runs on the summoned full parameters as they are: inside summon_full_params()
        with gradients off (inference, ``generate()``). With gradients on, :meth:`pre_forward` refuses: the
        gradients of summoned parameters would never reach the shards."""
        return self.state == TrainingState.SUMMON_FULL_PARAMS and not torch.is_grad_enabled()

    @eager
    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], guarded: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gather this unit's parameters and expose them. ``guarded=False``: the caller cannot undo a failing
        forward (no try block under torch.compile), so the root's next forward does."""
        if self.is_root and self._callback_queued and not backward_running():
            self._abandon_backward()
        if self.is_root and self._unguarded and self.state == TrainingState.FORWARD and not backward_running():
            self._abandon_forward()
        if self.state in IN_BACKWARD and not backward_running():
            raise RuntimeError(
                f"FullyShardedDataParallel unit '{self.name}' is in state {self.state.name} outside backward: a "
                "backward pass through it did not finish. Run forward through the root instance."
            )
        self.group.check_shards(self.name)
        recomputing = self.state in IN_BACKWARD  # activation checkpointing runs forward again inside backward
        self.transition("pre_forward")
        self._unguarded = not guarded
        args, kwargs = self.cast_inputs((args, kwargs))
        schedule = self.tree_schedule
        with record_function(f"shardkit::fsdp:pre_forward:{self.name}"):
            # A forward run again inside backward (activation checkpointing) neither records nor prefetches.
            first_pass = not recomputing and not backward_running()
            if first_pass:
                if self.is_root:
                    schedule.begin_forward()
                schedule.record_pre_forward(self)
            self.group.unshard(self.ctx)
            schedule.consume(self)
            if first_pass and self.policies.prefetch.forward:
                schedule.prefetch(schedule.next_in_forward(self))
            self.group.wait_unsharded()
            self.group.use_views()
        if not recomputing and self.group.has_frozen and torch.is_grad_enabled():
            args, kwargs = self._hook_inputs((args, kwargs))
        return args, kwargs

    @eager
    def post_forward(self, output: Any) -> Any:
        resumed_in_backward = self._resume_state[-1] in IN_BACKWARD
        self.transition("post_forward")
        self._unguarded = False
        if resumed_in_backward:
            return output  # recomputation during backward: the backward hooks own gathering and freeing
        schedule = self.tree_schedule
        schedule.record_post_forward(self)
        hooked = self._hook_outputs(output) if torch.is_grad_enabled() else False
        sharding = self.policies.sharding
        keep = hooked and ((self.is_root and sharding.disable_reshard_on_root) or not sharding.reshard_after_forward)
        if not keep:
            self.group.reshard()
        if self.is_root:
            schedule.release_unused()  # forward is over: drop prefetches no unit used
        return output

    @eager
    def forward_failed(self) -> None:
        """The wrapped forward raised: return to the previous state; free the parameters unless in backward."""
        resumed_in_backward = self._resume_state[-1] in IN_BACKWARD
        self.transition("post_forward")
        if not resumed_in_backward:
            self.group.reshard()
            if self.is_root:
                self.tree_schedule.release_unused()

    def prefetch_unshard(self) -> None:
        """Start gathering this unit's parameters ahead of its use (called by the schedule)."""
        with record_function(f"shardkit::fsdp:prefetch:{self.name}"):
            self.group.unshard(self.ctx)

    def _hook_outputs(self, output: Any) -> bool:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in tensors:
            tensor.register_hook(weak_method_hook(self._pre_backward_hook))
        return bool(tensors)

    def _hook_inputs(self, inputs: Any) -> Any:
        """Route the inputs that need gradients through a node that reports when their gradients are ready."""
        flat, spec = tree_flatten(inputs)
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return inputs
        self._inputs_pending += 1
        routed = _InputsGradReady.apply(self, *[flat[i] for i in positions])
        for i, tensor in zip(positions, routed):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        """Gather the parameters again before autograd computes this unit's gradients."""
        (self.root or self).queue_finish_backward()
        if self.state == TrainingState.BACKWARD_PRE and self.group.is_unsharded():
            return
        self.transition("pre_backward")
        schedule = self.tree_schedule
        with record_function(f"shardkit::fsdp:pre_backward:{self.name}"), torch.enable_grad():
            self.tree_reduces.poll()
            self.group.unshard(self.ctx)
            schedule.consume(self)
            if self.policies.prefetch.backward == BackwardPrefetch.BACKWARD_PRE:
                self._prefetch_backward()
            self.group.wait_unsharded()
            # Views made with grad enabled, for activation checkpointing that recomputes from the attributes.
            self.group.use_views()

    def post_backward(self, handle: FlatParamHandle) -> None:
        """One flat parameter's full gradient is complete: start its reduce-scatter and free the full copy."""
        (self.root or self).queue_finish_backward()
        self.transition("post_backward")
        with record_function(f"shardkit::fsdp:post_backward:{self.name}"):
            pending = self.group.post_backward(handle, self.sync_grads, self.ctx)
            self._grads_done += 1
            if self._grads_done == self.group.trainable_count:
                self._maybe_free_frozen()
                if self.policies.prefetch.backward == BackwardPrefetch.BACKWARD_POST:
                    self._prefetch_backward()
            self.tree_reduces.add(pending)

    def _prefetch_backward(self) -> None:
        # Only a unit backward has not reached yet: the root comes first in backward order but its last
        # gradient (the embedding's) is out only at the very end.
        schedule = self.tree_schedule
        target = schedule.next_in_backward(self)
        if target is not None and target.state not in IN_BACKWARD:
            schedule.prefetch(target)

    def inputs_grad_ready(self) -> None:
        """The gradients of one forward's inputs are computed (frozen parameters may no longer be needed)."""
        self._inputs_pending = max(0, self._inputs_pending - 1)
        self._maybe_free_frozen()

    def _maybe_free_frozen(self) -> None:
        # Frozen parameters serve backward only to carry gradients to the inputs and to this unit's trainable
        # parameters; once both are out they can go, instead of waiting for the end of backward.
        if self.state in IN_BACKWARD and self._inputs_pending == 0 and self._grads_done >= self.group.trainable_count:
            self.group.reshard_frozen()

    def queue_finish_backward(self) -> None:
        """Root only: have autograd's engine call :meth:`finish_backward` at the end of this backward (once)."""
        if not self._callback_queued:
            self._callback_queued = True
            queue_autograd_callback(self.finish_backward)

    def _abandon_forward(self) -> None:
        """A forward run without a guard (under torch.compile) raised: free what it gathered, return to IDLE."""
        self.schedule.release_unused()
        for unit in self.units or [self]:
            unit.abandon(in_backward=False)

    def _abandon_backward(self) -> None:
        """A backward pass raised before its end callback ran: drop its leftovers so training can go on."""
        self._callback_queued = False
        self.reduces.abandon()
        self.schedule.release_unused()
        for unit in self.units or [self]:
            unit.abandon(in_backward=True)

    def abandon(self, in_backward: bool) -> None:
        """Drop what a failed forward (``in_backward=False``) or backward left on this unit; back to IDLE."""
        if in_backward:
            self.group.abandon_backward()
            self._grads_done = 0
        else:
            self.group.reshard()
            self._unguarded = False
        self.transition("abandon")
        self._inputs_pending = 0

    def reset_backward_counts(self) -> None:
        """Forget this backward's gradient and input counts (the root's end-of-backward callback calls it)."""
        self._grads_done = self._inputs_pending = 0

    def finish_backward(self) -> None:
        """Root only, at the end of backward: wait for reductions, free full copies, return every unit to IDLE."""
        self._callback_queued = False
        stuck = []
        schedule = self.schedule
        with record_function("shardkit::fsdp:finish_backward"):
            for unit in self.units or [self]:
                if not may_start("finish_backward", unit.state):
                    stuck.append(unit)
                    continue
                unit.transition("finish_backward")
                for pending in unit.group.finish_backward(unit.sync_grads, self.comm):
                    self.reduces.add(pending)
                unit.reset_backward_counts()
            self.reduces.finish_all()
            schedule.release_unused()
        if stuck:
            names = ", ".join(f"'{u.name}' ({u.state.name}: {state_hint(u.state)})" for u in stuck)
            raise RuntimeError(
                f"FullyShardedDataParallel: backward finished but these units did not return to IDLE: {names}"
            )


class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the unit that the inputs' gradients are computed."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *tensors: torch.Tensor) -> Any:
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.unit.inputs_grad_ready()
        return (None, *grads)
