"""One wrapped unit's parameters: found, checked, flattened and sharded at wrap time; gathered, freed and
reduced at run time.

A unit owns every parameter under its module except those under nested
:class:`~shardkit.nn.fsdp.FullyShardedDataParallel` instances. Parameters are grouped into flat parameters by
``(dtype, requires_grad)`` so frozen weights (LoRA-style fine-tuning) never share a gradient buffer with
trainable ones, and tied parameters are stored once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Callable, Optional

import torch
from torch import nn

from shardkit.distributed.device import current_cuda_device
from shardkit.distributed.groups import GroupLike, group_size
from shardkit.memory.offload import to_host
from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.flat_param import Aliases, Owners, ParamLocation, build_meta
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.nn.fsdp.policies import FSDPPolicies
from shardkit.nn.fsdp.reduce import PendingReduce
from shardkit.nn.fsdp.start_values import agree_at_wrap


def _walk(module: nn.Module, is_unit: Callable[[nn.Module], bool], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Submodules with their paths, not descending into nested units (they own their parameters)."""
    if is_unit(module):
        return
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, is_unit, f"{prefix}.{name}" if prefix else name)


def collect_params(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> tuple[Owners, Aliases]:
    """Every parameter the unit owns, first occurrence first; later occurrences of a tied parameter are aliases
    (index into the owners list)."""
    owners: Owners = []
    aliases: Aliases = []
    index: dict[int, int] = {}
    for path, sub in _walk(module, is_unit):
        for attr, param in sub._parameters.items():
            if param is None:
                continue
            loc = ParamLocation(path, attr, sub)
            if id(param) in index:
                aliases.append((loc, index[id(param)]))
            else:
                index[id(param)] = len(owners)
                owners.append((loc, param))
    return owners, aliases


def collect_buffers(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> list[tuple[str, torch.Tensor]]:
    """Every buffer the unit's own submodules hold (not those under nested units), first occurrence only."""
    seen: set[int] = set()
    found = []
    for path, sub in _walk(module, is_unit):
        for attr, buffer in sub._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                found.append((f"{path}.{attr}" if path else attr, buffer))
    return found


def _validate(owners: Owners, policies: FSDPPolicies) -> None:
    devices = {p.device for _, p in owners}
    if len(devices) > 1:
        raise ValueError(f"FullyShardedDataParallel needs all parameters of a unit on one device, found {devices}")
    for loc, param in owners:
        if not param.is_floating_point():
            raise TypeError(
                f"parameter '{loc.fqn}' has dtype {param.dtype}; only floating-point parameters can be sharded. "
                "Register integer state as a buffer instead."
            )
        if policies.mixed_precision.enabled and param.dtype != torch.float32:
            raise TypeError(
                f"parameter '{loc.fqn}' is {param.dtype}, but mixed precision keeps FP32 master shards and "
                f"computes in {policies.mixed_precision.param_dtype}. Call model.float() before wrapping, or "
                "drop mixed_precision/compute_dtype to train in the parameters' own dtype."
            )


def _check_not_sharded_by_nested(owners: Owners, nested: Sequence[ParamGroup]) -> None:
    for loc, param in owners:
        for group in nested:
            if group.sharded_original(param):
                raise ValueError(
                    f"parameter '{loc.fqn}' is tied to a parameter already sharded by the nested unit wrapping "
                    f"{type(group.owner.wrapped_module).__name__}; tied parameters must live in one unit. Wrap the "
                    "modules sharing it together (e.g. leave both the embedding and the output projection in the "
                    "outer unit). The model was left unchanged."
                )


def _group_by_kind(owners: Owners, aliases: Aliases, flatten: bool) -> list[tuple[Owners, Aliases]]:
    """Split into flat parameters: one per (dtype, requires_grad), or one per parameter without flattening."""
    keys: dict[object, int] = {}
    groups: list[tuple[Owners, Aliases]] = []
    where: list[tuple[int, int]] = []  # owner index -> (group, index inside group)
    for i, (loc, p) in enumerate(owners):
        key: object = (p.dtype, p.requires_grad) if flatten else i
        if key not in keys:
            keys[key] = len(groups)
            groups.append(([], []))
        g = keys[key]
        where.append((g, len(groups[g][0])))
        groups[g][0].append((loc, p))
    for loc, i in aliases:
        g, j = where[i]
        groups[g][1].append((loc, j))
    return groups


def _compute_device(owners: Owners, policies: FSDPPolicies) -> torch.device:
    if policies.offload.compute_device is not None:
        return policies.offload.compute_device
    device = owners[0][1].device if owners else torch.device("cpu")
    if policies.offload.offload_params and device.type == "cpu" and torch.cuda.is_available():
        return current_cuda_device()  # cuda:LOCAL_RANK, selected now if the script did not
    return device


def _cast_after_wrapping(unit_name: str, handle: FlatParamHandle, policies: FSDPPolicies) -> str:
    """What to say when a shard's dtype changed since wrapping (``model.to(torch.bfloat16)``, ``.half()``)."""
    now, then = handle.shard.dtype, handle.meta.dtype
    computes_in = policies.mixed_precision.param_dtype or then
    return (
        f"FullyShardedDataParallel unit '{unit_name}': the model was cast to {now} after it was wrapped (its shard "
        f"'{handle.name}' was {then} at wrap time; e.g. model.to({now}), .half(), .bfloat16()). A cast after "
        f"wrapping changes only the stored shards, not the dtype the unit gathers and computes in ({computes_in}): "
        "training would go on in a dtype other than the one the parameters, gradients and state dict show, or fail "
        f"on mismatched dtypes. Cast the model before wrapping (FSDP(model.to({now}))), or keep float32 parameters "
        f"and compute in {now} with mixed_precision=True, compute_dtype={now}."
    )


def _shard_tensor(local: torch.Tensor, policies: FSDPPolicies, compute_device: torch.device) -> torch.Tensor:
    """A private copy of this rank's chunk: in CPU memory under offload (pinned when compute is on CUDA, so
    uploads can overlap compute), else where the parameters are."""
    if not policies.offload.offload_params:
        return local.clone()
    return to_host(local, pin=compute_device.type == "cuda")


class ParamGroup:
    """The flat parameters of one wrapped unit and the operations the runtime applies to all of them."""

    def __init__(
        self,
        owner: nn.Module,
        handles: list[FlatParamHandle],
        group: GroupLike,
        world_size: int,
        policies: FSDPPolicies,
        originals: Sequence[nn.Parameter] = (),
    ) -> None:
        self.owner = owner
        self.handles = handles
        self.group = group
        self.world_size = world_size
        self.policies = policies
        replica = policies.reduce.replica_group
        #: Ranks holding the same shards (hybrid sharding across nodes, NO_SHARD): gradients average over
        #: ``world_size * replica_size`` ranks.
        self.replica_size = 1 if replica is None else group_size(replica)
        self._summoned: Optional[list[tuple[torch.Tensor, list[nn.Parameter]]]] = None
        #: The original parameters this unit replaced by shards (weakly held), to catch ties across units.
        self._originals: dict[int, weakref.ref[nn.Parameter]] = {id(p): weakref.ref(p) for p in originals}

    def sharded_original(self, param: nn.Parameter) -> bool:
        """True if ``param`` is one of the original parameters this unit flattened and sharded."""
        ref = self._originals.get(id(param))
        return ref is not None and ref() is param

    @classmethod
    def build(
        cls,
        owner: nn.Module,
        module: nn.Module,
        group: GroupLike,
        rank: int,
        world_size: int,
        policies: FSDPPolicies,
        is_unit: Callable[[nn.Module], bool],
        label: str,
        nested: Sequence[ParamGroup] = (),
    ) -> ParamGroup:
        """Shard ``module``'s parameters and register the shards on ``owner`` as ``flat_param_<i>``.

        Everything that can fail (dtypes, devices, shapes differing across ranks) is checked before the first
        change, so a failed wrap leaves the model as it was. Values differing across ranks are replaced by rank 0's
        (:mod:`~shardkit.nn.fsdp.start_values`).
        """
        owners, aliases = collect_params(module, is_unit)
        _validate(owners, policies)
        _check_not_sharded_by_nested(owners, nested)
        compute_device = _compute_device(owners, policies)
        buffers = collect_buffers(module, is_unit)
        replica = policies.reduce.replica_group
        agree_at_wrap(owners, aliases, buffers, group, replica, rank, compute_device, label)  # refuses, or rank 0's
        handles = []
        with torch.no_grad():
            for i, (g_owners, g_aliases) in enumerate(
                _group_by_kind(owners, aliases, policies.sharding.flatten_parameters)
            ):
                meta = build_meta(g_owners, g_aliases, world_size, rank)
                full = meta.flatten([p for _, p in g_owners], device=g_owners[0][1].device)
                shard = nn.Parameter(
                    _shard_tensor(meta.local_shard(full), policies, compute_device), meta.requires_grad
                )
                dtype = policies.mixed_precision.param_dtype or meta.dtype
                handles.append(
                    FlatParamHandle(
                        meta,
                        f"flat_param_{i}",
                        shard,
                        [(loc.module, loc.attr) for loc, _ in g_owners],
                        [(loc.module, loc.attr) for loc, _ in g_aliases],
                        compute_device,
                        dtype,
                        f"{label}.flat_param_{i}" if label else f"flat_param_{i}",
                        follow_shard_device=not policies.offload.offload_params
                        and policies.offload.compute_device is None,
                    )
                )
        for loc, _ in owners:
            loc.module._parameters.pop(loc.attr, None)
        for loc, _ in aliases:
            loc.module._parameters.pop(loc.attr, None)
        for handle in handles:
            owner.register_parameter(handle.name, handle.shard)
            handle.drop_views()  # placeholders under the original names until the first forward
        return cls(owner, handles, group, world_size, policies, [p for _, p in owners])

    # ------------------------------------------------------------------ forward / backward
    def unshard(self, ctx: CommContext) -> None:
        """Start gathering every flat parameter (asynchronously; see :meth:`wait_unsharded`)."""
        for handle in self.handles:
            handle.unshard(self.group, ctx)

    def wait_unsharded(self) -> None:
        """Block until the gathers started by :meth:`unshard` have landed."""
        for handle in self.handles:
            handle.wait_unsharded()

    def use_views(self) -> None:
        for handle in self.handles:
            handle.use_views()

    def reshard(self) -> None:
        for handle in self.handles:
            handle.drop_views()
            handle.reshard()

    def reshard_frozen(self) -> None:
        """Free the flat parameters that get no gradient (their backward use is over)."""
        for handle in self.handles:
            if not handle.meta.requires_grad:
                handle.drop_views()
                handle.reshard()

    def is_unsharded(self) -> bool:
        return any(h.is_unsharded for h in self.handles)

    @property
    def has_frozen(self) -> bool:
        """True when some flat parameter of this unit gets no gradient."""
        return any(not h.meta.requires_grad for h in self.handles)

    @property
    def trainable_count(self) -> int:
        """How many flat parameters of this unit get gradients (post-backward fires once for each)."""
        return sum(1 for h in self.handles if h.meta.requires_grad)

    def check_shards(self, unit_name: str) -> None:
        """Adopt shards that ``model.to()`` replaced by new objects; under offload, insist they stay on CPU."""
        for handle in self.handles:
            registered = self.owner._parameters.get(handle.name)
            if registered is not None and registered is not handle.shard:
                handle.shard = registered
            if handle.shard.dtype != handle.meta.dtype:
                raise RuntimeError(_cast_after_wrapping(unit_name, handle, self.policies))
        if not self.policies.offload.offload_params:
            return
        for handle in self.handles:
            if handle.shard.device.type != "cpu":
                raise RuntimeError(
                    f"FullyShardedDataParallel unit '{unit_name}' offloads its parameters to CPU "
                    f"(cpu_offload/move_params_to_cpu), but its shard '{handle.name}' is on {handle.shard.device}. "
                    "Do not move an offloaded model after wrapping (no model.cuda()/model.to()): full parameters "
                    "are gathered on compute_device for you. Move the model before wrapping without offload instead."
                )

    def post_backward(self, handle: FlatParamHandle, sync_grads: bool, ctx: CommContext) -> Optional[PendingReduce]:
        """Reduce (or, under ``no_sync``, accumulate) one flat parameter's full gradient, then free it."""
        grad = handle.take_full_grad()
        pending = None
        if sync_grads:
            pending = self._reduce(handle, grad, ctx)
        elif grad is not None:
            handle.accumulate_unsynced(grad)
        handle.drop_views()
        handle.reshard()
        return pending

    @property
    def dp_size(self) -> int:
        """Ranks a gradient is averaged over: the shard group times its replicas."""
        return self.world_size * self.replica_size

    def _reduce(
        self, handle: FlatParamHandle, grad: Optional[torch.Tensor], ctx: CommContext
    ) -> Optional[PendingReduce]:
        reduce = self.policies.reduce
        return handle.reduce_grad(
            grad,
            self.group,
            self.world_size,
            self.policies.mixed_precision.reduce_dtype,
            ctx,
            reduce.divide_factors(self.dp_size),  # gradient_predivide_factor; None: start_reduce chooses
            reduce.replica_group,
            self.replica_size,
        )

    def finish_backward(self, sync_grads: bool, ctx: CommContext) -> list[PendingReduce]:
        """End of backward: reduce gradients left from ``no_sync`` steps and free everything.

        Returns the reductions started here, for the caller to finish.
        """
        pending = []
        for handle in self.handles:
            if sync_grads and handle.grad_accum is not None:
                started = self._reduce(handle, None, ctx)
                if started is not None:
                    pending.append(started)
        self.abandon_backward()  # what is left of this backward: its full gradients and gathered copies
        return pending

    def abandon_backward(self) -> None:
        """Forget what a backward pass left (at its end, or when it failed midway): full gradients and gathered
        copies."""
        for handle in self.handles:
            if handle.full is not None:
                handle.full.grad = None
        self.reshard()

    def unsharded_bytes(self) -> int:
        """Bytes held by full parameter copies right now (zero once every flat parameter is resharded)."""
        return sum(h.unsharded_bytes() for h in self.handles)

    # ------------------------------------------------------------------ summon_full_params
    def summon(self) -> None:
        """Register the original parameters as ``nn.Parameter`` views of a full-precision gathered copy."""
        self.reshard()
        summoned = []
        for handle in self.handles:
            shard = handle.shard.detach()
            full = torch.empty(handle.meta.padded_numel, dtype=shard.dtype, device=handle.compute_device)
            _collectives.all_gather_params(full, shard.to(full.device), self.group, handle.label)
            params = [nn.Parameter(v, requires_grad=handle.shard.requires_grad) for v in handle.meta.views(full)]
            self.owner._parameters.pop(handle.name)
            handle.clear_attrs()  # an attribute in the instance dict would hide the registered parameter
            for (module, attr), param in zip(handle.locations, params):
                module.register_parameter(attr, param)
            for (module, attr), info in zip(handle.alias_locations, handle.meta.shared):
                module._parameters[attr] = params[info.primary]
            summoned.append((full, params))
        self._summoned = summoned

    def is_summoned(self) -> bool:
        """True between :meth:`summon` and :meth:`unsummon`."""
        return self._summoned is not None

    def unsummon(self, writeback: bool) -> None:
        """Undo :meth:`summon`; with ``writeback`` copy this rank's part of the (edited) values into the shard."""
        assert self._summoned is not None
        for handle, (full, params) in zip(self.handles, self._summoned):
            if writeback:
                with torch.no_grad():
                    for (module, attr), info, param in zip(handle.locations, handle.meta.params, params):
                        current = getattr(module, attr)
                        if current.data_ptr() != param.data_ptr():  # replaced rather than edited in place
                            full[info.offset : info.offset + info.numel].copy_(current.reshape(-1))
                    handle.shard.data.copy_(handle.meta.local_shard(full))
            for module, attr in handle.locations + handle.alias_locations:
                module._parameters.pop(attr, None)
            handle.drop_views()
            self.owner.register_parameter(handle.name, handle.shard)
        self._summoned = None
