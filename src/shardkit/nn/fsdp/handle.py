"""One flat parameter at run time: its shard, its full copy while gathered, and its gradient in flight.

The shard is the ``nn.Parameter`` the optimizer sees. The full copy is a separate leaf tensor in the compute
dtype whose storage is allocated on unshard and resized to zero on reshard, so freeing it never changes the
tensor objects autograd saved. Original parameters are exposed as views of it (one ``split``), which makes
autograd accumulate every original gradient into ``full.grad``; a post-accumulate hook on the leaf then tells
the runtime the unit's gradient for this flat parameter is complete.

Writes into the full buffer go through ``.data`` so they do not bump the autograd version counter shared
with the views saved for backward: the values written are always the same parameters.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from shardkit.distributed.collectives import Handle
from shardkit.distributed.groups import GroupLike
from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.flat_param import FlatParamMeta


class FlatParamHandle:
    """Shard, full buffer and pending gradient reduction of one flat parameter."""

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
        #: Unsharded gradient summed locally under ``no_sync`` (master dtype), reduced at the next synced backward.
        self.grad_accum: Optional[torch.Tensor] = None
        self._pending: list[tuple[Handle, torch.Tensor, torch.Tensor]] = []
        #: Called once this flat parameter's full gradient of a backward pass is complete.
        self.on_grad_ready: Callable[[FlatParamHandle], None] = lambda handle: None

    # ------------------------------------------------------------------ gather / free
    def _alloc_full(self) -> torch.Tensor:
        full = self.full
        if full is None or full.device != self.compute_device or full.dtype != self.compute_dtype:
            full = torch.empty(self.meta.padded_numel, dtype=self.compute_dtype, device=self.compute_device)
            full.requires_grad_(self.shard.requires_grad)
            if self.meta.requires_grad:
                full.register_post_accumulate_grad_hook(self._grad_accumulated)
            self.full = full
        else:
            full.requires_grad_(self.shard.requires_grad)
            nbytes = self.meta.padded_numel * full.element_size()
            if full.untyped_storage().size() != nbytes:
                full.data.untyped_storage().resize_(nbytes)
        return full

    def unshard(self, group: GroupLike) -> None:
        """All-gather the full flat parameter in the compute dtype onto the compute device."""
        if self.is_unsharded:
            return
        if self.follow_shard_device:
            self.compute_device = self.shard.device
        full = self._alloc_full()
        local = self.shard.detach().to(self.compute_device, self.compute_dtype, non_blocking=True)
        _collectives.all_gather_params(full.data, local, group, self.label)
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the full flat parameter's memory (the tensor object, and views of it, stay valid objects)."""
        if self.is_unsharded and self.full is not None:
            self.full.data.untyped_storage().resize_(0)
        self.is_unsharded = False

    def unsharded_bytes(self) -> int:
        """Bytes currently held by the full copy (zero when resharded)."""
        return 0 if self.full is None else self.full.untyped_storage().nbytes()

    # ------------------------------------------------------------------ original parameters as views
    def use_views(self) -> None:
        """Expose the original parameters as views of the full buffer (plain tensor attributes)."""
        assert self.full is not None and self.is_unsharded
        views = self.meta.views(self.full)
        for (module, attr), view in zip(self.locations, views):
            setattr(module, attr, view)
        for (module, attr), info in zip(self.alias_locations, self.meta.shared):
            setattr(module, attr, views[info.primary])

    def drop_views(self) -> None:
        """Remove the view attributes, so stale parameters cannot be read after the memory is freed."""
        for module, attr in self.locations + self.alias_locations:
            module.__dict__.pop(attr, None)

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
        self, grad: Optional[torch.Tensor], group: GroupLike, world_size: int, reduce_dtype: Optional[torch.dtype]
    ) -> None:
        """Start reduce-scattering ``grad`` (plus anything accumulated under ``no_sync``), averaged over ranks."""
        if self.grad_accum is not None:
            accum, self.grad_accum = self.grad_accum, None
            grad = accum if grad is None else accum.add_(grad.to(accum.dtype))
        if grad is None:
            return
        dtype = reduce_dtype or self.compute_dtype
        # The gradient tensor is ours (autograd handed it over), so scaling it in place is safe.
        grad = grad.to(dtype)
        if world_size > 1:
            grad.div_(world_size)
        grad_shard = torch.empty(self.meta.shard_numel, dtype=dtype, device=grad.device)
        work = _collectives.reduce_scatter_grads(grad_shard, grad, group, self.label)
        self._pending.append((work, grad_shard, grad))

    def finish_reduce(self) -> None:
        """Wait for started reductions and add their results to the shard's gradient (master dtype)."""
        for work, grad_shard, _ in self._pending:
            work.wait()
            grad_shard = grad_shard.to(self.shard.device, self.shard.dtype)
            if self.shard.grad is None:
                self.shard.grad = grad_shard
            else:
                self.shard.grad.add_(grad_shard)
        self._pending.clear()

    def abandon_reduce(self) -> None:
        """Drop started reductions without applying them (after a failed backward)."""
        self._pending.clear()

    def has_pending_reduce(self) -> bool:
        return bool(self._pending)
