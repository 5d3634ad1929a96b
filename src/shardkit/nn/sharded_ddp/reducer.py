"""Reducing each gradient to the rank that owns it, overlapped with the backward pass.

Lifecycle of one synchronised backward pass (a *round*):

1. ``post_accumulate_grad`` hook of a planned parameter fires: its gradient is final. The first hook of the
   round queues :meth:`GradReducer._end_of_backward` on the autograd engine. The gradient is divided by the
   world size and either packed into its unit's flat buffer (a non-owner frees ``.grad`` at once) or kept to be
   reduced in place.
2. Units are launched (asynchronous ``reduce`` to the owner) strictly in plan order, each as soon as it and all
   units before it are complete. Every rank follows the same plan, so the collectives match across ranks even
   when gradients become ready in a different order.
3. At the end of backward, units with parameters that got no gradient on this rank are filled (a gradient
   accumulated earlier under ``no_sync`` counts, otherwise zeros) and launched; one small all-reduce counts,
   per parameter, the ranks that contributed a gradient. After waiting for everything, owners write the
   averaged gradient into ``.grad``, or leave ``.grad`` None for a parameter no rank produced a gradient for
   (what torch DDP does with ``find_unused_parameters=True``); non-owners are left with ``.grad = None``.

Hybrid sharding (``replica`` group: the same local rank on the other nodes): the reduce to the owner runs
inside the node; the owner waits for it as it launches it (fast link) and at once starts all-reducing the node's
sum with the owners on the other nodes, in plan order, so every replica issues the same sequence and the slow
part overlaps the rest of backward. The average runs over all nodes.

Under ``no_sync`` the hooks only record that local gradients are pending; :meth:`GradReducer.reduce_now` then
runs steps 2-3 by hand over whatever the parameters hold (fairscale's ``ShardedDataParallel.reduce()``).
"""

from __future__ import annotations

import enum
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.hooks import RemovableHandle

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike, group_rank, group_size, on_host_path
from shardkit.nn.sharded_ddp.plan import ReduceUnit, plan_reduction
from shardkit.nn.sharded_ddp.policy import ReducePolicy
from shardkit.utils._torch_private import queue_autograd_callback
from shardkit.utils.autograd import weak_method_hook

#: Attribute naming, on each hooked parameter, the reducer that hooks it (a weak reference).
_REDUCER_ATTR = "_shardkit_sdp_reducer"


class ReducerState(enum.Enum):
    """IDLE between backward passes; REDUCING from the first gradient hook of a synced backward to its end."""

    IDLE = enum.auto()
    REDUCING = enum.auto()


@dataclass
class RoundStats:
    """What the last synchronised backward pass did (for tests and profiling)."""

    launched_during_backward: int = 0
    launched_at_end: int = 0
    bytes_reduced: int = 0


class _UnitRound:
    """The per-round state of one :class:`ReduceUnit`."""

    def __init__(self, unit: ReduceUnit) -> None:
        self.unit = unit
        self.ready = [False] * len(unit.params)
        self.pending = len(unit.params)
        self.tensor: Optional[torch.Tensor] = None  # what is reduced: a flat buffer, or the gradient itself
        self.handle: Optional[collectives.Handle] = None
        #: The cross-node all-reduce of the owner's sum (hybrid sharding), once started.
        self.replica_handle: Optional[collectives.Handle] = None
        self.released = False


class GradReducer:
    """Hooks a model's trainable parameters and reduces their gradients to their owner ranks.

    ``rebuild`` (re)plans the units and (re)registers the hooks; ``sync_enabled`` is set by the wrapper at every
    forward (False under ``no_sync``). With a group of one rank nothing is hooked: gradients are already final.
    """

    def __init__(self, group: GroupLike, policy: ReducePolicy, replica: Optional[GroupLike] = None) -> None:
        self.group = group
        self.dp_rank = group_rank(group)
        self.dp_size = group_size(group)
        self.replica = replica
        #: Ranks a gradient is averaged over: the node's group times the nodes (hybrid sharding).
        self.average_over = self.dp_size * (group_size(replica) if replica is not None else 1)
        self.policy = policy
        self.sync_enabled = True
        #: True while some gradient accumulated under ``no_sync`` has not been reduced yet.
        self.pending_local = False
        self.state = ReducerState.IDLE
        self.last_round: Optional[RoundStats] = None
        self.units: list[ReduceUnit] = []
        self._slot_of: dict[torch.Tensor, tuple[int, int]] = {}
        self._flag_of: dict[torch.Tensor, int] = {}
        self._hooks: list[RemovableHandle] = []
        self._round: list[_UnitRound] = []
        self._contributed: list[bool] = []
        self._next_launch = 0
        self._next_release = 0
        self._stats = RoundStats()

    # ----------------------------------------------------------------------------------------------- planning
    def rebuild(self, params: Sequence[torch.Tensor], owner_of: Mapping[torch.Tensor, int]) -> None:
        """Plan the units for ``params`` (in expected gradient order) and hook them; drops the previous plan."""
        self._expect_idle("re-plan the gradient reduction")
        self.remove_hooks()
        if self.average_over == 1:
            self.units = []
            return
        self._take_over(params)
        self.units = plan_reduction(params, owner_of, self.policy)
        self._slot_of = {}
        self._flag_of = {}
        for unit_index, unit in enumerate(self.units):
            for member, p in enumerate(unit.params):
                self._slot_of[p] = (unit_index, member)
                self._flag_of[p] = len(self._flag_of)
                self._hooks.append(p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready)))

    def _take_over(self, params: Sequence[torch.Tensor]) -> None:
        """Unhook an earlier reducer of these same parameters: two live wrappers would reduce every gradient twice."""
        for p in params:
            previous = getattr(p, _REDUCER_ATTR, None)
            prior = previous() if previous is not None else None
            if prior is not None and prior is not self and prior.reduces(p):
                prior.remove_hooks()
                warnings.warn(
                    "ShardedDataParallel: this model was already wrapped by another ShardedDataParallel; the earlier "
                    "wrapper's gradient hooks were removed (it no longer reduces anything). Use the new wrapper.",
                    stacklevel=5,
                )
            setattr(p, _REDUCER_ATTR, weakref.ref(self))

    def reduces(self, param: torch.Tensor) -> bool:
        """True when ``param``'s gradient is hooked and reduced by this reducer."""
        return param in self._slot_of

    def remove_hooks(self) -> None:
        """Detach every gradient hook (the model then trains without any reduction)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._slot_of = {}

    def _expect_idle(self, action: str) -> None:
        if self.state is not ReducerState.IDLE:
            raise RuntimeError(
                f"ShardedDataParallel cannot {action} while a backward pass is reducing gradients; do it "
                "between optimizer steps (after loss.backward() has returned)."
            )

    # ------------------------------------------------------------------------------------------- backward pass
    def _begin_round(self) -> None:
        self.state = ReducerState.REDUCING
        self._round = [_UnitRound(unit) for unit in self.units]
        self._contributed = [False] * len(self._flag_of)
        self._next_launch = 0
        self._next_release = 0
        self._stats = RoundStats()

    def reduce_now(self) -> None:
        """Reduce the gradients the parameters hold now (accumulated under ``no_sync``) as a backward pass would.

        Every rank must call it. Afterwards owners hold the averaged gradients and every other rank ``None``.
        """
        self._expect_idle("reduce gradients by hand")
        if not self.units:
            self.pending_local = False
            return
        self._begin_round()
        self._end_of_backward()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            self.pending_local = True  # no_sync: the gradient keeps accumulating locally, to be reduced later
            return
        if self.state is ReducerState.IDLE:
            self._begin_round()
            queue_autograd_callback(self._end_of_backward)
        unit_index, member = self._slot_of[param]
        unit_round = self._round[unit_index]
        if unit_round.ready[member]:
            raise RuntimeError(
                "ShardedDataParallel saw the same parameter's gradient twice in one backward pass. Reentrant "
                "activation checkpointing is not supported: use torch.utils.checkpoint(..., use_reentrant=False)."
            )
        grad = param.grad
        if grad is not None and (grad.is_sparse or grad.requires_grad):
            raise RuntimeError(
                "ShardedDataParallel reduces dense gradients that do not require grad: sparse gradients and "
                "backward(create_graph=True) are not supported."
            )
        self._take(unit_round, member)
        if unit_round.pending == 0:
            self._launch_ready()
        self._release_completed()

    def _take(self, unit_round: _UnitRound, member: int) -> None:
        """Record ``member``'s final local gradient (None counts as zero) in its unit, pre-divided."""
        unit = unit_round.unit
        p = unit.params[member]
        grad = p.grad
        self._contributed[self._flag_of[p]] = grad is not None
        if unit.packed:
            if unit_round.tensor is None:
                unit_round.tensor = torch.empty(unit.numel, dtype=unit.wire_dtype, device=p.device)
            view = unit_round.tensor[unit.offsets[member] : unit.offsets[member] + p.numel()].view(p.shape)
            if grad is None:
                view.zero_()
            elif grad.dtype == view.dtype:
                torch.div(grad, self.average_over, out=view)  # copy and average in one pass
            else:
                view.copy_(grad)  # convert first, then divide, as torch's fp16 compression hook does
                view.div_(self.average_over)
            if grad is not None and unit.owner != self.dp_rank:
                p.grad = None  # its value now lives in the bucket
        elif grad is None:
            unit_round.tensor = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            unit_round.tensor = grad if grad.is_contiguous() else grad.contiguous()
            if not self._direct(unit_round.tensor):
                unit_round.tensor.div_(self.average_over)  # else only the owner divides, after the sum
        unit_round.ready[member] = True
        unit_round.pending -= 1

    def _launch_ready(self) -> None:
        """Launch, in plan order, every unit whose gradients are all recorded and whose predecessors launched."""
        while self._next_launch < len(self._round) and self._round[self._next_launch].pending == 0:
            self._launch(self._round[self._next_launch])
            self._next_launch += 1
            self._stats.launched_during_backward += 1

    def _launch(self, unit_round: _UnitRound) -> None:
        unit = unit_round.unit
        assert unit_round.tensor is not None
        label = f"sdp_grad_bucket{len(unit.params)}" if len(unit.params) > 1 else "sdp_grad"
        tensor = unit_round.tensor
        unit_round.handle = collectives.reduce(
            tensor, unit.owner, group=self.group, async_op=True, label=label, by_sends=self._direct(tensor)
        )
        self._stats.bytes_reduced += unit.nbytes
        if self.replica is not None and unit.owner == self.dp_rank:
            # Hybrid: the node's sum arrives over the fast link; send it across nodes at once, so the slow
            # all-reduce overlaps the rest of backward (launches run in plan order: one order on every replica).
            unit_round.handle.wait()
            self._replicate(unit_round)

    def _direct(self, tensor: torch.Tensor) -> bool:
        """Reduce by a direct send to the owner: for CPU tensors (gloo) between two ranks.

        There a reduce is one send and gloo's ``reduce`` takes about twice the time and CPU (which the backward
        pass is using); with more ranks the owner would have to hold one received copy per peer. A gradient
        reduced on its own is then divided by the owner after the sum instead of by every rank before it:
        ``(a + b) / 2`` equals DDP's ``a / 2 + b / 2`` exactly, and the non-owner skips a pass over it.
        """
        return self.dp_size == 2 and on_host_path(self.group, tensor)

    def _release_completed(self) -> None:
        """Finish reduces that already arrived, in plan order, without waiting for the others.

        A non-owner frees its copy of the gradient; an owner adds what it received now, which frees the
        receive buffer during the backward pass instead of at its end (lower peak memory, and on CPU the freed
        memory serves the next allocations instead of fresh pages).
        """
        while self._next_release < self._next_launch:
            unit_round = self._round[self._next_release]
            assert unit_round.handle is not None
            if not unit_round.handle.is_completed():
                return
            unit_round.handle.wait()
            self._release(unit_round)
            self._replicate(unit_round)
            self._next_release += 1

    def _replicate(self, unit_round: _UnitRound) -> None:
        """Owner only, hybrid sharding: start all-reducing the node's sum with the same owner on the other nodes.

        Called in plan order (from :meth:`_release_completed`, then for the rest at the end of backward), so the
        replicas issue their all-reduces in one order."""
        if self.replica is None or unit_round.unit.owner != self.dp_rank or unit_round.replica_handle is not None:
            return
        assert unit_round.tensor is not None
        unit_round.replica_handle = collectives.all_reduce(
            unit_round.tensor, group=self.replica, async_op=True, label="sdp_grad_replicas"
        )
        self._stats.bytes_reduced += unit_round.unit.nbytes

    def _release(self, unit_round: _UnitRound) -> None:
        unit = unit_round.unit
        if unit_round.released or unit.owner == self.dp_rank:
            return
        if not unit.packed:
            unit.params[0].grad = None
        unit_round.tensor = None
        unit_round.released = True

    def _end_of_backward(self) -> None:
        """Queued on the autograd engine: flush, wait, and leave owners with averaged gradients."""
        try:
            for unit_round in self._round[self._next_launch :]:
                for member, done in enumerate(unit_round.ready):
                    if not done:
                        self._take(unit_round, member)
                self._launch(unit_round)
                self._stats.launched_at_end += 1
            self._next_launch = len(self._round)
            device = self.units[0].params[0].device
            counts = torch.tensor(self._contributed, dtype=torch.int32, device=device)
            collectives.all_reduce(counts, group=self.group, label="sdp_used_flags")
            for unit_round in self._round:
                assert unit_round.handle is not None
                unit_round.handle.wait()
                self._replicate(unit_round)
            if self.replica is not None:
                # A gradient used on another node only counts too. Issued after every cross-node all-reduce of
                # the round: how many of those started during backward differs between nodes, their order not.
                collectives.all_reduce(counts, group=self.replica, label="sdp_used_flags:inter")
            used = [c > 0 for c in counts.tolist()]
            for unit_round in self._round:
                self._release(unit_round)
                if unit_round.replica_handle is not None:
                    unit_round.replica_handle.wait()
                if unit_round.unit.owner == self.dp_rank:
                    self._write_owned(unit_round, used)
            self.last_round = self._stats
            self.pending_local = False
        finally:
            self._round = []
            self.state = ReducerState.IDLE

    def _write_owned(self, unit_round: _UnitRound, used: list[bool]) -> None:
        unit = unit_round.unit
        reduced = unit_round.tensor
        assert reduced is not None
        for member, p in enumerate(unit.params):
            if not used[self._flag_of[p]]:
                p.grad = None  # no rank produced a gradient: leave it untouched by the optimizer, like DDP
                continue
            if unit.packed:
                value = reduced[unit.offsets[member] : unit.offsets[member] + p.numel()].view(p.shape)
            else:
                value = reduced.div_(self.average_over) if self._direct(reduced) else reduced
            if p.grad is None and not unit.packed:
                p.grad = value
            elif p.grad is None:
                p.grad = torch.empty_like(p)
                p.grad.copy_(value)
            elif p.grad is not value:
                p.grad.copy_(value)
