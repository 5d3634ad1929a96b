"""``ShardedDataParallel``: data parallelism whose gradients are sharded like the optimizer state (ZeRO-2)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed.buckets import REDUCE_BUCKET_BYTES
from shardkit.distributed.groups import GroupLike, global_rank, group_rank, group_size
from shardkit.distributed.hybrid import HybridSpec, agree_across_nodes, shard_and_replica
from shardkit.distributed.model_check import check_same_model
from shardkit.nn.optimizer_order import check_optimizers_hold_model, refuse_steps_inside
from shardkit.nn.sharded_ddp import state_dict as sd_keys
from shardkit.nn.sharded_ddp.policy import ReducePolicy, SyncPolicy
from shardkit.nn.sharded_ddp.reducer import GradReducer, ReducerState, RoundStats
from shardkit.nn.sharded_ddp.startup import broadcast_across_nodes, sync_module_states
from shardkit.optim.zero1 import OSS


def _as_sharded_optimizers(sharded_optimizer: Any) -> list[OSS]:
    """The optimizers as a list, or a TypeError that says to wrap a plain optimizer in OSS."""
    optimizers = list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
    if not optimizers:
        raise ValueError("ShardedDataParallel needs at least one OSS optimizer; got an empty list")
    for optimizer in optimizers:
        if isinstance(optimizer, OSS):
            continue
        what = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
        raise TypeError(
            f"ShardedDataParallel needs sharded optimizers (shardkit.optim.OSS), got {what}: it reduces each "
            "gradient only to the rank that updates that parameter, which only OSS knows. Wrap your optimizer, "
            "e.g. OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1), and pass that (or a list of them)."
        )
    return optimizers


def _members(group: GroupLike) -> tuple[int, ...]:
    return tuple(global_rank(group, i) for i in range(group_size(group)))


def _common_group(process_group: Any, optimizers: Sequence[OSS]) -> tuple[GroupLike, Optional[GroupLike]]:
    """The group to reduce over and the replica group across nodes: the optimizers', which ``process_group`` (a
    group, or a node description for hybrid sharding) must match when given."""
    members = _members(optimizers[0].group)
    replicas = _replica_members(optimizers[0])
    for index, optimizer in enumerate(optimizers[1:], start=1):
        if _members(optimizer.group) != members or _replica_members(optimizer) != replicas:
            raise ValueError(
                f"sharded optimizer {index} shards over ranks {list(_members(optimizer.group))} (replicas "
                f"{list(_replica_members(optimizer))}) but optimizer 0 over {list(members)} (replicas "
                f"{list(replicas)}); every OSS given to one ShardedDataParallel must use the same group"
            )
    if process_group is None:
        return optimizers[0].group, optimizers[0].replica_group
    group, replica = shard_and_replica(process_group, "ShardedDataParallel")
    theirs = tuple(global_rank(replica, i) for i in range(group_size(replica))) if replica is not None else ()
    if _members(group) != members or theirs != replicas:
        nodes = f" (replicas {list(theirs)} and {list(replicas)} across nodes)" if theirs or replicas else ""
        raise ValueError(
            f"process_group holds ranks {list(_members(group))} but the OSS optimizers shard over ranks "
            f"{list(members)}{nodes}: gradients must be reduced within the optimizers' group (and across the same "
            "nodes). Pass the same group (or node description) to both, or leave process_group=None to use the "
            "optimizers'."
        )
    return group, replica


def _replica_members(optimizer: OSS) -> tuple[int, ...]:
    replica = optimizer.replica_group
    return () if replica is None else _members(replica)


def _owner_map(optimizers: Sequence[OSS]) -> dict[torch.Tensor, int]:
    """Owner rank of every trainable parameter of every optimizer; the optimizers must not share parameters."""
    owner_of: dict[torch.Tensor, int] = {}
    for index, optimizer in enumerate(optimizers):
        for p, owner in optimizer.param_to_rank.items():
            if p in owner_of:
                raise ValueError(
                    f"a parameter of shape {list(p.shape)} is held by sharded optimizer {index} and an earlier "
                    "one; give each OSS its own parameters"
                )
            owner_of[p] = owner
    return owner_of


def _devices_of(module: nn.Module) -> tuple[str, set[torch.device]]:
    """The device type of ``module``'s parameters (one only, as torch DDP requires) and their devices."""
    devices = {p.device for p in module.parameters()}
    types = sorted({d.type for d in devices})
    if len(types) > 1:
        raise ValueError(
            f"ShardedDataParallel needs the module's parameters on one device type, found {types}: move the whole "
            "model to one device type first (model.to(device))."
        )
    return (types[0] if types else "cpu"), devices


class ShardedDataParallel(nn.Module):
    """Wrap a model so that each gradient is reduced only to the rank whose OSS shard updates it (ZeRO-2).

    During backward every gradient is averaged over the group with an asynchronous ``reduce`` to its owner,
    small gradients packed into flat buffers of up to ``reduce_buffer_size`` bytes; the reduces overlap the rest
    of the backward pass, and when ``loss.backward()`` returns the owners hold averaged gradients while every
    other rank has ``.grad = None``, so gradients take ~1/world_size of their usual memory. ``optimizer.step()``
    then updates each shard and broadcasts it.

    Args:
        module: the model, identical on every rank (checked at construction).
        sharded_optimizer: one :class:`~shardkit.optim.OSS`, or a list of them over disjoint parameters.
        process_group: group to reduce over; defaults to the optimizers' group (and must match it). Hybrid
            sharding: give the OSS optimizers the nodes (an ``(intra, inter)`` pair, 2-D mesh or Topology);
            each gradient is then reduced to its owner inside the node and the owner's reduced gradient
            all-reduced with the same owner on the other nodes (only shard-sized traffic crosses nodes).
        broadcast_buffers: copy rank 0's buffers to every rank at each forward, as torch DDP does.
        sync_models_at_startup: copy rank 0's parameters and buffers to every rank at construction. The shapes
            are always checked first: ranks that built different models fail here, on every rank.
        reduce_buffer_size: bytes of one flat buffer of small gradients (0: every gradient reduced alone).
        auto_refresh_trainable: detect ``requires_grad`` changes at forward and call :meth:`refresh_trainable`.
        reduce_fp16: reduce fp32 gradients as fp16 (half the bytes, lower precision). Unlike fairscale, which
            turns it off when ``reduce_buffer_size > 0``, it also applies to packed gradients.
        warn_on_trainable_params_changed: warn when a forward finds that parameters' ``requires_grad`` changed
            (and, with ``auto_refresh_trainable``, the optimizers are re-partitioned).

    Semantics worth knowing:

    - A parameter that got no gradient on some ranks (unused in their forward) counts as zero there; one that
      got no gradient on any rank keeps ``.grad = None`` and is skipped by the optimizer, exactly like torch
      DDP with ``find_unused_parameters=True``. Every rank must run a backward that reaches at least one
      parameter held by the optimizers.
    - Call ``zero_grad()`` after each ``step()``: a gradient left from a synced step is counted again as a local
      contribution. Use :meth:`no_sync` to accumulate gradients over several backward passes.
    - ``requires_grad`` changes must be made on every rank alike.
    - Gradients are reduced by any backward pass outside :meth:`no_sync`, in train or eval mode, as with torch
      DDP; a forward in eval mode followed by no backward communicates nothing but the buffers.
    - Casting or moving the model after wrapping (``sdp.to(...)``, ``model.half()``) is noticed at the next
      forward, which re-plans the reduction for the new dtypes and devices (OSS rebuilds its buckets at its
      next step).
    - Attributes the wrapper lacks are looked up on the wrapped module (``sdp.my_attribute``), and torch DDP's
      ``module``, ``device_type`` and ``is_multi_device_module`` are there, for code that expects a DDP.
    - ``state_dict()`` keys carry the ``module.`` level, as fairscale's and torch DDP's do, so checkpoints load
      strictly into either; ``load_state_dict`` also accepts the plain model's keys (``sdp.module.state_dict()``
      gives those).

    Example::

        model = MyModel().to(device)
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        model = ShardedDataParallel(model, optimizer)
        for inputs, targets in data:
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            model.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: Union[OSS, Sequence[OSS]],
        process_group: Union[GroupLike, HybridSpec, None] = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = REDUCE_BUCKET_BYTES,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
    ) -> None:
        super().__init__()
        # Everything that can reject the input runs before the first collective or change. The optimizers and
        # the group come first (they say who takes part); what else this rank refuses travels with the model
        # check, so a rank-specific refusal raises on every rank instead of leaving the others waiting.
        optimizers = _as_sharded_optimizers(sharded_optimizer)
        group, replica = _common_group(process_group, optimizers)
        error: Optional[Exception] = None
        try:
            owner_of = _owner_map(optimizers)
            check_optimizers_hold_model(module, owner_of)
            self.reduce_policy = ReducePolicy(bucket_bytes=reduce_buffer_size, reduce_fp16=reduce_fp16)
            self.sync_policy = SyncPolicy(
                broadcast_buffers, sync_models_at_startup, auto_refresh_trainable, warn_on_trainable_params_changed
            )
            device_type, devices = _devices_of(module)
        except (TypeError, ValueError) as exc:
            error = exc
        agree_across_nodes(
            lambda g, err: check_same_model(module, g, "ShardedDataParallel", local_error=err), group, replica, error
        )

        self.module = module
        #: torch DDP's attributes, for code that inspects them: the parameters' device type, and whether they
        #: span several devices.
        self.device_type: str = device_type
        self.is_multi_device_module: bool = len(devices) > 1
        self.sharded_optimizers = optimizers
        self.process_group = group
        #: Hybrid sharding: the ranks with this rank's shard on the other nodes (None: one node).
        self.replica_group = replica
        self.dp_rank = group_rank(group)
        self.dp_size = group_size(group)
        self._no_sync = False
        self._reducer = GradReducer(group, self.reduce_policy, replica)
        if self.sync_policy.sync_models_at_startup:
            sync_module_states(module, group, self._chunk_bytes, replica)
        self._trainable_flags = self._current_trainable_flags()
        self._plan(owner_of)
        sd_keys.install(self)

    def extra_repr(self) -> str:
        policy = self.reduce_policy
        return (
            f"dp_size={self.dp_size}, optimizers={len(self.sharded_optimizers)}, "
            f"reduce_buffer_size={policy.bucket_bytes}, reduce_fp16={policy.reduce_fp16}, "
            f"reduce_units={len(self._reducer.units)}"
        )

    @property
    def _chunk_bytes(self) -> int:
        return self.reduce_policy.bucket_bytes or REDUCE_BUCKET_BYTES

    @property
    def reduce_stats(self) -> Optional[RoundStats]:
        """What the last synchronised backward pass launched (None before the first one)."""
        return self._reducer.last_round

    def _current_trainable_flags(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.module.parameters())

    def _current_layout(self) -> tuple[tuple[torch.dtype, torch.device], ...]:
        return tuple((p.dtype, p.device) for p in self.module.parameters())

    def _scan_parameters(self) -> tuple[tuple[bool, ...], tuple[tuple[torch.dtype, torch.device], ...]]:
        """``requires_grad`` flags and (dtype, device) of the parameters, after refusing a gradient that itself
        requires grad (one pass)."""
        flags = []
        layout = []
        for p in self.module.parameters():
            grad = p.grad
            if grad is not None and grad.requires_grad:
                name = next(n for n, q in self.module.named_parameters() if q is p)
                raise RuntimeError(
                    f"ShardedDataParallel: the gradient of parameter '{name}' requires grad (left by "
                    "backward(create_graph=True), or set by hand); only plain gradients can be reduced. Clear it "
                    "first, e.g. model.zero_grad(set_to_none=True), or detach it."
                )
            flags.append(p.requires_grad)
            layout.append((p.dtype, p.device))
        return tuple(flags), tuple(layout)

    def _plan(self, owner_of: Mapping[torch.Tensor, int]) -> None:
        """Hook the trainable parameters held by the optimizers, in reverse registration order."""
        self._layout = self._current_layout()
        planned: list[torch.Tensor] = []
        orphans: list[str] = []
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if p in owner_of:
                planned.append(p)
            else:
                orphans.append(name)
        if orphans:
            warnings.warn(
                f"ShardedDataParallel: {len(orphans)} parameter(s) require grad but no sharded optimizer holds "
                f"them ({', '.join(orphans[:5])}{', ...' if len(orphans) > 5 else ''}); their gradients are "
                "neither reduced nor freed. Pass them to an OSS, or set requires_grad=False.",
                stacklevel=3,
            )
        self._reducer.rebuild(planned[::-1], owner_of)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module, as in fairscale."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not set yet (inside __init__): nothing to forward to
                raise
            return getattr(self.module, name)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, after refreshing trainability and syncing buffers as configured."""
        if self._reducer.state is not ReducerState.IDLE:
            raise RuntimeError(
                "ShardedDataParallel: forward called while the previous backward pass is still reducing (did it "
                "raise?). Gradients are inconsistent across ranks; restart from a checkpoint."
            )
        flags, layout = self._scan_parameters()
        if flags != self._trainable_flags:
            if self.sync_policy.warn_on_trainable_params_changed:
                warnings.warn(
                    "ShardedDataParallel: parameters' requires_grad changed since the last forward"
                    + ("; re-partitioning the optimizers." if self.sync_policy.auto_refresh_trainable else "."),
                    stacklevel=2,
                )
            if self.sync_policy.auto_refresh_trainable:
                self.refresh_trainable()
            else:
                self._trainable_flags = flags
        elif layout != self._layout:  # model cast or moved (sdp.to(...), model.half()): the plan depends on both
            self._plan(_owner_map(self.sharded_optimizers))
        if self.sync_policy.broadcast_buffers:
            self.sync_buffers()
        self._reducer.sync_enabled = not self._no_sync
        return self.module(*inputs, **kwargs)

    def refresh_trainable(self) -> None:
        """Re-partition the optimizers and re-plan the reduction after ``requires_grad`` changed.

        Called automatically at forward with ``auto_refresh_trainable=True``; call it yourself otherwise.
        """
        if self._reducer.state is not ReducerState.IDLE:
            raise RuntimeError("ShardedDataParallel.refresh_trainable cannot run during a backward pass")
        for optimizer in self.sharded_optimizers:
            optimizer.refresh_trainable()
        self._trainable_flags = self._current_trainable_flags()
        self._plan(_owner_map(self.sharded_optimizers))

    def sync_buffers(self, blocking: bool = False) -> None:
        """Copy rank 0's buffers (BatchNorm statistics, ...) to every rank; call on every rank.

        ``blocking`` is fairscale's flag to wait for the copies: they are always complete when this returns,
        so ``blocking=False`` is accepted and behaves like ``True`` (never a half-copied buffer).
        """
        buffers = [b.detach() for b in self.module.buffers()]
        broadcast_across_nodes(buffers, self.process_group, self.replica_group, self._chunk_bytes, "sdp_buffers")

    def reduce(self) -> None:
        """Reduce by hand the gradients accumulated under :meth:`no_sync`, instead of a last synced backward.

        Call it on every rank, after the accumulating backward passes and before ``optimizer.step()``; owners
        then hold the gradients averaged over the ranks and every other rank ``None``, exactly as after a synced
        backward. A backward pass outside ``no_sync`` reduces by itself: this is only for accumulation that
        ends without one.

        Example::

            for x, y in micro_batches:
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            model.reduce()
            optimizer.step()
        """
        if not self._reducer.pending_local:
            raise RuntimeError(
                "ShardedDataParallel.reduce: no gradient is waiting to be reduced (no backward pass ran under "
                "no_sync() since the last reduction). A backward pass outside no_sync() reduces by itself; "
                "calling reduce() after it would count the reduced gradients again."
            )
        self._reducer.reduce_now()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run inside this block communicate nothing.

        The next backward of a forward run outside the block reduces the accumulated sum. Non-owners keep full
        gradients while accumulating, so memory is that of plain DDP until the synced step.

        Example::

            with model.no_sync():
                loss_fn(model(x0), y0).backward()
            loss_fn(model(x1), y1).backward()  # reduces the sum of both
            optimizer.step()
        """
        previous = self._no_sync
        self._no_sync = True
        try:
            with refuse_steps_inside(self.module.parameters(), "ShardedDataParallel"):
                yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the wrapped model's gradients: zero them in place (fairscale's default), or drop them.

        Args:
            set_to_none: drop the gradients (``.grad = None``) instead of zeroing them, which saves memory.
        """
        self.module.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load fairscale's and torch DDP's keys (``module.fc.weight``, what :meth:`state_dict` returns) or the
        wrapped model's own (``fc.weight``); a strict mismatch says which forms are accepted."""
        return sd_keys.load_explained(super().load_state_dict, state_dict, strict, assign)
