"""``FullyShardedDataParallel``: the public ZeRO-3 wrapper (fairscale's arguments, shardkit's internals)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike, group_rank, group_size, resolve_group
from shardkit.nn.fsdp import grad_norm, ties
from shardkit.nn.fsdp._collectives import create_reduce_channels
from shardkit.nn.fsdp._names import clean_members, clean_named_modules
from shardkit.nn.fsdp._state_dict_methods import StateDictMethods
from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import BackwardPrefetch, CPUOffload, policies_from_args
from shardkit.nn.fsdp.runtime import TrainingState, Unit, make_input_caster


class FullyShardedDataParallel(StateDictMethods, nn.Module):
    """Shard a module's parameters, gradients and optimizer state across a process group (ZeRO-3).

    Each rank keeps ``1/world_size`` of every parameter as a flat FP32 shard; ``model.parameters()`` yields only
    these shards, so an optimizer built *after* wrapping steps only them. Full parameters exist only while a
    wrapped unit runs: gathered before its forward (and again before its backward), freed afterwards.
    Gradients are reduce-scattered (averaged) into the shards' ``.grad``.

    Nest instances to bound memory: an inner instance owns its parameters, the outer one the rest. The
    outermost instance to run forward becomes the root; it casts inputs for mixed precision and finishes
    every backward pass.

    Args:
        module: the module to wrap; available afterwards as ``.module``.
        process_group: group to shard over (default: the world); a ``DummyProcessGroup(rank=0, size=1)`` runs
            without ``torch.distributed``.
        reshard_after_forward: free full parameters after forward and gather them again for backward.
        mixed_precision: gather and compute in ``compute_dtype`` (default float16) with FP32 master shards.
        fp32_reduce_scatter: reduce gradients in FP32 under mixed precision.
        flatten_parameters: one flat tensor per (dtype, requires_grad) per unit; False shards each parameter.
        move_params_to_cpu: keep FP32 shards and their gradients in CPU memory (pinned when computing on CUDA);
            the optimizer then steps on CPU. Full parameters are still gathered on ``compute_device``.
        compute_dtype: dtype of full parameters during compute (enables mixed precision when 16-bit).
        buffer_dtype: dtype floating-point buffers are cast to (default: ``compute_dtype`` under mixed precision).
        move_grads_to_cpu: must match parameter offload (gradients live beside their shards).
        bucket_cap_mb: accepted for compatibility; each flat parameter is already reduced in one collective.
        compute_device: where full parameters are gathered (default: the parameters' device; CUDA under offload
            when available).
        state_dict_device: where full state dicts are materialised.
        cpu_offload: ``CPUOffload(offload_params=True)``, torch's spelling of ``move_params_to_cpu``.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` starts gathering the next unit (in backward order)
            in this unit's pre-backward hook, so the gather overlaps this unit's gradient computation, at the
            cost of one more unit's full parameters in memory; ``BACKWARD_POST`` starts it once this unit's
            gradients are out (less overlap, no extra memory); None (default) gathers each unit when it starts.
        forward_prefetch: from the second step on, start gathering the next unit (in the previous forward's
            order) when a unit starts its forward. Prefetching never changes results; at most one unit is
            gathered ahead of its use.

    Notes:
        - Original parameters exist as attributes of their submodules only during forward/backward and inside
          :meth:`summon_full_params`; between steps ``model.module.fc.weight`` raises ``AttributeError``.
        - A parameter unused in a step gets a zero gradient when it shares a flat parameter with used ones;
          a unit that does not run at all keeps its gradient (None). Every rank must run the same units, or the
          reductions of the ranks no longer line up.
        - Parameters tied across two units are rejected: keep tied modules in one unit.
        - Frozen parameters are gathered for backward, freed as soon as the unit's backward is over, never reduced.
        - Communication is asynchronous: gathers run ahead as prefetches, reduce-scatters run on a second process
          group over the same ranks (created with ``new_group`` at the root's first forward, on every rank), and
          on CUDA on their own streams. With one rank nothing is gathered or copied.

    Example::

        model = FullyShardedDataParallel(MyModel())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)   # built after wrapping: sees only shards
        loss = model(x).sum()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        with model.summon_full_params():
            print(dict(model.named_parameters()).keys())     # original names and shapes

    Overlapping communication, and shards kept in CPU memory::

        blocks = [FSDP(b, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True) for b in blocks]
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))   # optimizer then steps on CPU
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[GroupLike] = None,
        reshard_after_forward: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_grads_to_cpu: Optional[bool] = None,
        bucket_cap_mb: float = 25,
        compute_device: Optional[Union[torch.device, str, int]] = None,
        state_dict_device: Optional[Union[torch.device, str]] = None,
        cpu_offload: Optional[CPUOffload] = None,
        backward_prefetch: Optional[BackwardPrefetch] = None,
        forward_prefetch: bool = False,
    ) -> None:
        super().__init__()
        policies = policies_from_args(
            reshard_after_forward=reshard_after_forward,
            flatten_parameters=flatten_parameters,
            mixed_precision=mixed_precision,
            fp32_reduce_scatter=fp32_reduce_scatter,
            compute_dtype=compute_dtype,
            buffer_dtype=buffer_dtype,
            move_params_to_cpu=move_params_to_cpu,
            move_grads_to_cpu=move_grads_to_cpu,
            cpu_offload=cpu_offload,
            compute_device=compute_device,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            bucket_cap_mb=bucket_cap_mb,
            state_dict_device=state_dict_device,
        )
        group = resolve_group(process_group, "FullyShardedDataParallel")
        self.process_group = group
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        self._policies = policies
        label = type(module).__name__
        nested = [_unit_of(m).group for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        # May raise; nothing has been changed yet.
        tied = ties.check_unclaimed(module, _is_unit)  # refuses a parameter another unit already shards
        param_group = ParamGroup.build(
            self, module, group, self.rank, self.world_size, policies, _is_unit, label, nested
        )
        ties.claim(self, module, tied)
        self.module = module
        self._unit = Unit(param_group, policies, label)
        if policies.mixed_precision.param_dtype is not None:
            # Every mixed-precision unit casts its floating-point inputs (a no-op below a mixed-precision root),
            # so a mixed-precision unit inside a full-precision root still gets inputs of its compute dtype.
            self._unit.cast_inputs = make_input_caster(policies.mixed_precision.param_dtype)
        #: Original dtypes of floating-point buffers cast for mixed precision (clean name -> dtype), root only.
        self.buffer_original_dtypes: dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------ settings
    @property
    def mixed_precision(self) -> bool:
        return self._policies.mixed_precision.enabled

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return self._policies.mixed_precision.param_dtype

    @property
    def buffer_dtype(self) -> Optional[torch.dtype]:
        return self._policies.mixed_precision.buffer_dtype

    @property
    def fp32_reduce_scatter(self) -> bool:
        return self._policies.mixed_precision.reduce_dtype == torch.float32

    @property
    def flatten_parameters(self) -> bool:
        return self._policies.sharding.flatten_parameters

    @property
    def reshard_after_forward(self) -> bool:
        return self._policies.sharding.reshard_after_forward

    @property
    def move_params_to_cpu(self) -> bool:
        return self._policies.offload.offload_params

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._policies.offload.offload_params)

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        return self._policies.prefetch.backward

    @property
    def forward_prefetch(self) -> bool:
        return self._policies.prefetch.forward

    @property
    def state_dict_device(self) -> Optional[torch.device]:
        return self._policies.state_dict.device

    @property
    def training_state(self) -> TrainingState:
        return self._unit.state

    @property
    def is_root(self) -> Optional[bool]:
        """True for the outermost instance once a forward has run (None before)."""
        return self._unit.is_root

    # ------------------------------------------------------------------ flat-parameter metadata
    @property
    def flat_params(self) -> list[nn.Parameter]:
        """This unit's shards, in order (each registered on this instance as ``flat_param_<i>``)."""
        return [h.shard for h in self._unit.group.handles]

    @property
    def flat_param_names(self) -> list[str]:
        """Attribute names of :attr:`flat_params` on this instance."""
        return [h.name for h in self._unit.group.handles]

    @property
    def flat_param_metas(self) -> list[FlatParamMeta]:
        """Layout of each flat parameter: original names (relative to ``.module``), shapes, offsets, padding
        and this rank's shard range. See :mod:`shardkit.nn.fsdp.flat_param`."""
        return [h.meta for h in self._unit.group.handles]

    def unsharded_bytes(self) -> int:
        """Bytes this unit currently holds in full (gathered) parameter copies; 0 when fully resharded."""
        return self._unit.group.unsharded_bytes()

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        args, kwargs = self._unit.pre_forward(args, kwargs)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            # e.g. a user error, or activation checkpointing stopping a recomputation early on purpose
            self._unit.forward_failed()
            raise
        return self._unit.post_forward(output)

    def _lazy_init(self) -> None:
        """At the first forward of the outermost instance: mark it root, mark nested instances non-root."""
        unit = self._unit
        if unit.is_root is not None:
            return
        unit.is_root, unit.root, unit.units = True, None, []
        unit.name = f"<root {type(self.module).__name__}>"
        for path, module in clean_named_modules(self, _is_unit):
            if isinstance(module, FullyShardedDataParallel):
                if module is not self:
                    module._unit.is_root, module._unit.root, module._unit.units = False, unit, []
                    module._unit.name = path
                unit.units.append(module._unit)
        # Every rank runs the root's first forward at the same point: the one moment to create process groups.
        unit.comm = CommContext(create_reduce_channels([u.group.group for u in unit.units]))
        mp = self._policies.mixed_precision
        if mp.buffer_dtype is not None:
            self._cast_buffers(mp.buffer_dtype)

    def _cast_buffers(self, dtype: torch.dtype) -> None:
        for path, module in clean_named_modules(self, _is_unit):
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    self.buffer_original_dtypes[f"{path}.{name}" if path else name] = buf.dtype
                    module._buffers[name] = buf.to(dtype)

    # ------------------------------------------------------------------ names
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters named as in the unwrapped model: wrapper levels do not add a ``module.`` segment.

        Outside :meth:`summon_full_params` these are the shards (``<unit path>.flat_param_<i>``); inside it, the
        original parameters with their original names.
        """
        if not recurse:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        yield from clean_members(self, _is_unit, "_parameters", prefix, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers named as in the unwrapped model (see :meth:`named_parameters`)."""
        if not recurse:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        yield from clean_members(self, _is_unit, "_buffers", prefix, remove_duplicate)

    def __getattr__(self, name: str) -> Any:
        """Fall back to the wrapped module's attributes (``fsdp.get_input`` reaches ``fsdp.module.get_input``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (when it is a container such as ``nn.Sequential``)."""
        return self.module.__getitem__(key)  # type: ignore[operator]

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, flatten_parameters={self.flatten_parameters}, "
            f"reshard_after_forward={self.reshard_after_forward}, mixed_precision={self.mixed_precision}"
        )

    # ------------------------------------------------------------------ full parameters
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
        """Gather full-precision parameters and expose them under their original names inside the block.

        With ``writeback`` the values (edited in place or reassigned, same shape) are copied back into the
        shards on exit; every rank keeps its own part, so edits should agree across ranks. Not allowed inside
        forward or backward. Example::

            with model.summon_full_params():
                model.module.fc.weight.mul_(0.5)
        """
        targets = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)] if recurse else [self]
        entered: list[FullyShardedDataParallel] = []
        try:
            for fsdp in targets:
                if fsdp._unit.state == TrainingState.SUMMON_FULL_PARAMS:
                    continue  # already summoned by an enclosing call
                fsdp._unit.transition("summon")
                entered.append(fsdp)
                fsdp._unit.group.summon()
            yield
        finally:
            for fsdp in reversed(entered):
                if fsdp._unit.group._summoned is not None:
                    fsdp._unit.group.unsummon(writeback)
                fsdp._unit.transition("unsummon")

    def apply(self, fn: Any) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with full parameters, written back to the shards (e.g. custom initialisation)."""
        if self._unit.state == TrainingState.SUMMON_FULL_PARAMS:
            return super().apply(fn)
        with self.summon_full_params(recurse=True, writeback=True):
            return super().apply(fn)

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for backward passes inside the block.

        Costs memory: every unit keeps an *unsharded* gradient (master dtype) until the next backward outside
        the block reduce-scatters the sum, so peak memory grows by the full model's gradient size, as in DDP.
        """
        units = [m._unit for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        previous = [u.sync_grads for u in units]
        for u in units:
            u.sync_grads = False
        try:
            yield
        finally:
            for u, before in zip(units, previous):
                u.sync_grads = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every unit by their true global norm; call on the root, on every rank.

        Handles units sharded over different groups (e.g. experts in a size-one group). Returns the norm
        before clipping.
        """
        self._lazy_init()
        if not self._unit.is_root:
            raise RuntimeError(
                f"clip_grad_norm_ was called on the nested unit '{self._unit.name}'; call it on the root (outermost) "
                "FullyShardedDataParallel instance, whose norm covers the gradients of every unit"
            )
        self._unit.assert_state(TrainingState.IDLE)
        return grad_norm.clip_grad_norm_(self._unit.units, max_norm, norm_type)


def _unit_of(module: FullyShardedDataParallel) -> Unit:
    unit: Unit = module._unit
    return unit


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FullyShardedDataParallel)
