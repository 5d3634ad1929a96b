"""One flat parameter at run time: its shard, its full copy while gathered, and its gradient on the way out.

The shard is the ``nn.Parameter`` the optimizer sees. The full copy is a separate leaf tensor in the compute
dtype whose storage is allocated on unshard and resized to zero on reshard, so freeing it never changes the
tensor objects autograd saved, and the same tensor object (with its gradient hook) is reused every step.
Original parameters are exposed as views of it (one ``split``), which makes autograd accumulate every original
gradient into ``full.grad``; a post-accumulate hook on the leaf then tells the runtime the unit's gradient for
this flat parameter is complete.

Gathers are asynchronous: :meth:`FlatParamHandle.unshard` only issues the all-gather (so it can run ahead as a
prefetch) and :meth:`FlatParamHandle.wait_unsharded` waits for it before compute reads the values.

With one rank and nothing to cast, the full copy *is* the shard (a detached alias of its storage): nothing is
gathered, copied or freed, and the full gradient becomes the shard's gradient as it is.

Writes into the full buffer go through ``.data`` so they do not bump the autograd version counter shared
with the views saved for backward: the values written are always the same parameters.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from shardkit import memory
from shardkit.distributed.collectives import Handle
from shardkit.distributed.groups import GroupLike
from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.comm_context import CommContext, join
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.placeholder import ShardedParamPlaceholder
from shardkit.nn.fsdp.reduce import PendingReduce, start_reduce
from shardkit.utils.autograd import weak_method_hook
from shardkit.utils.tensors import FLAT_SHARD_MARK


class FlatParamHandle:
    """Shard, full buffer and gradient bookkeeping of one flat parameter."""

    def __init__(
        self,
        meta: FlatParamMeta,
        name: str,
        shard: nn.Parameter,
        locations: list[tuple[nn.Module, str]],
        alias_locations: list[tuple[nn.Module, str]],
        compute_device: torch.device,
        compute_dtype: torch.dtype,
        label: str,
        follow_shard_device: bool = False,
    ) -> None:
        self.meta = meta
        #: Attribute name of :attr:`shard` on the FullyShardedDataParallel instance, e.g. ``flat_param_0``.
        self.name = name
        self.shard = shard
        setattr(shard, FLAT_SHARD_MARK, True)  # answers isinstance(p, FlatParameter), as Lightning 1.x asks
        #: ``(submodule, attribute)`` of each entry of ``meta.params`` and of ``meta.shared``.
        self.locations = locations
        self.alias_locations = alias_locations
        self.compute_device = compute_device
        self.compute_dtype = compute_dtype
        self.label = label
        #: Gather onto wherever the shard lives (no offload, no explicit compute device), so ``model.to(device)``
        #: after wrapping moves computation too.
        self.follow_shard_device = follow_shard_device
        self.full: Optional[torch.Tensor] = None
        self.is_unsharded = False
        #: The full copy is a detached alias of the shard (one rank, same dtype and device): never freed.
        self._aliased = False
        self._gather: Optional[Handle] = None
        self._gather_stream: Optional[torch.cuda.Stream] = None
        #: Unsharded gradient summed locally under ``no_sync`` (master dtype), reduced at the next synced backward.
        self.grad_accum: Optional[torch.Tensor] = None
        #: Called once this flat parameter's full gradient of a backward pass is complete.
        self.on_grad_ready: Callable[[FlatParamHandle], None] = lambda handle: None
        #: What the parameter attributes hold between steps (one per entry of ``meta.params``), made for the
        #: ``(device, dtype)`` key beside them and remade when the shard moves.
        self._placeholders: list[ShardedParamPlaceholder] = []
        self._placeholder_key: Optional[tuple[torch.device, torch.dtype]] = None

    # ------------------------------------------------------------------ gather / free
    def _new_full(self, full: torch.Tensor) -> torch.Tensor:
        full.requires_grad_(self.shard.requires_grad)
        if self.meta.requires_grad:
            full.register_post_accumulate_grad_hook(weak_method_hook(self._grad_accumulated))
        self.full = full
        return full

    def _alloc_full(self) -> torch.Tensor:
        full = self.full
        if self._aliased or full is None or full.device != self.compute_device or full.dtype != self.compute_dtype:
            self._aliased = False
            return self._new_full(
                torch.empty(self.meta.padded_numel, dtype=self.compute_dtype, device=self.compute_device)
            )
        full.requires_grad_(self.shard.requires_grad)
        nbytes = self.meta.padded_numel * full.element_size()
        if full.untyped_storage().size() != nbytes:
            full.data.untyped_storage().resize_(nbytes)
        return full

    def _can_alias(self) -> bool:
        shard = self.shard
        return (
            self.meta.world_size == 1
            and shard.dtype == self.compute_dtype
            and shard.device == self.compute_device
            and shard.numel() == self.meta.padded_numel
        )

    def _alias_shard(self) -> None:
        full = self.full
        shard = self.shard
        # Re-alias when the shard's storage was replaced (model.to(), load into .data).
        if not self._aliased or full is None or full.data_ptr() != shard.data_ptr() or full.dtype != shard.dtype:
            self._aliased = True
            self._new_full(shard.detach())

    def unshard(self, group: GroupLike, ctx: CommContext) -> None:
        """Start gathering the full flat parameter in the compute dtype onto the compute device.

        The gather runs in the background; call :meth:`wait_unsharded` before reading the values.
        """
        if self.is_unsharded:
            return
        if self.follow_shard_device:
            self.compute_device = self.shard.device
        self.is_unsharded = True
        if self._can_alias():
            self._alias_shard()
            return
        with ctx.gather.issue(self.compute_device) as stream:
            full = self._alloc_full()
            local = self.shard.detach().to(self.compute_device, self.compute_dtype, non_blocking=True)
            self._gather = _collectives.all_gather_params(full.data, local, group, self.label, async_op=True)
            self._gather_stream = stream
        memory.tag(full, memory.Category.PARAMETERS)

    def wait_unsharded(self) -> None:
        """Block until the gather started by :meth:`unshard` has filled the full buffer."""
        gather = self._gather
        if gather is not None:
            self._gather = None
            gather.wait()
            join(self._gather_stream)
            if self._gather_stream is not None and self.full is not None:
                # Allocated on the gather stream, read by the compute stream from now on: reshard's resize_(0)
                # must not hand the memory back to the gather stream while queued compute kernels still read it.
                self.full.record_stream(torch.cuda.current_stream(self.full.device))
            self._gather_stream = None

    def reshard(self) -> None:
        """Free the full flat parameter's memory (the tensor object, and views of it, stay valid objects)."""
        if self._gather is not None:
            self.wait_unsharded()  # never free memory a gather is still writing into
        if self.is_unsharded and self.full is not None and not self._aliased:
            self.full.data.untyped_storage().resize_(0)
        self.is_unsharded = False

    def unsharded_bytes(self) -> int:
        """Bytes currently held by the full copy (zero when resharded; an alias of the shard counts while in use)."""
        if self.full is None or not self.is_unsharded:
            return 0
        return self.full.untyped_storage().nbytes()

    # ------------------------------------------------------------------ original parameters as views
    def use_views(self) -> None:
        """Expose the original parameters as views of the full buffer (plain tensor attributes).

        Written into the instance dict, where ``drop_views`` puts the placeholders: it wins over a placeholder
        listed in ``_parameters`` while :mod:`shardkit.nn.fsdp.hf_models` lists the original parameters."""
        assert self.full is not None and self.is_unsharded
        views = self.meta.views(self.full)
        for (module, attr), view in zip(self.locations, views):
            module.__dict__[attr] = view
        for (module, attr), info in zip(self.alias_locations, self.meta.shared):
            module.__dict__[attr] = views[info.primary]

    def drop_views(self) -> None:
        """Replace the view attributes by placeholders, so stale parameters cannot be read after the memory is
        freed while ``print(model)`` and ``module.weight.shape`` keep working."""
        placeholders = self.placeholders()
        for (module, attr), placeholder in zip(self.locations, placeholders):
            module.__dict__[attr] = placeholder
        for (module, attr), info in zip(self.alias_locations, self.meta.shared):
            module.__dict__[attr] = placeholders[info.primary]

    def clear_attrs(self) -> None:
        """Remove the attributes altogether (before registering real parameters under their names)."""
        for module, attr in self.locations + self.alias_locations:
            module.__dict__.pop(attr, None)

    def placeholders(self) -> list[ShardedParamPlaceholder]:
        """One placeholder per original parameter (shape, dtype and device; no values), in ``meta.params``
        order; made once per ``(device, dtype)`` of the shard and reused."""
        device = self.shard.device if self.follow_shard_device else self.compute_device
        key = (device, self.shard.dtype)
        if key != self._placeholder_key:
            unit = self.label.rpartition(".flat_param_")[0] or self.label
            self._placeholders = [
                ShardedParamPlaceholder(info.shape, key[1], device, info.requires_grad, info.fqn, unit)
                for info in self.meta.params
            ]
            self._placeholder_key = key
        return self._placeholders

    # ------------------------------------------------------------------ gradients
    def _grad_accumulated(self, full: torch.Tensor) -> None:
        self.on_grad_ready(self)

    def take_full_grad(self) -> Optional[torch.Tensor]:
        """Detach the unsharded gradient autograd accumulated (None if this flat parameter got none)."""
        if self.full is None or self.full.grad is None:
            return None
        grad = self.full.grad
        self.full.grad = None
        return grad

    def accumulate_unsynced(self, grad: torch.Tensor) -> None:
        """``no_sync``: sum the full gradient locally in the master dtype, without communication."""
        grad = grad.to(self.shard.dtype)
        if self.grad_accum is None:
            self.grad_accum = grad
        else:
            self.grad_accum.add_(grad)

    def reduce_grad(
        self,
        grad: Optional[torch.Tensor],
        group: GroupLike,
        world_size: int,
        reduce_dtype: Optional[torch.dtype],
        ctx: CommContext,
        divide: Optional[tuple[float, float]] = None,
        replica: Optional[GroupLike] = None,
        replica_size: int = 1,
    ) -> Optional[PendingReduce]:
        """Start reduce-scattering ``grad`` (plus anything accumulated under ``no_sync``), averaged over ranks,
        then (``replica``, hybrid sharding) all-reducing the shard over the ``replica_size`` replicas.

        Returns the reduction in flight (None when there was no gradient); its ``finish()`` adds the result to
        the shard's ``.grad``.
        """
        if self.grad_accum is not None:
            accum, self.grad_accum = self.grad_accum, None
            grad = accum if grad is None else accum.add_(grad.to(accum.dtype))
        if grad is None:
            return None
        if self._aliased and replica_size == 1:
            if divide is not None and divide[0] * divide[1] != 1:
                grad = grad / (divide[0] * divide[1])  # explicit factors apply with one rank too
            return PendingReduce.ready(self.shard, grad)  # one rank: the full gradient is the shard's
        dtype = reduce_dtype or self.compute_dtype
        return start_reduce(self.shard, grad, dtype, group, world_size, self.label, ctx, divide, replica, replica_size)
