"""``FullyShardedDataParallel``: the public ZeRO-3 wrapper (fairscale's arguments, shardkit's internals)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike, group_rank, group_size, resolve_group
from shardkit.nn.fsdp import grad_norm, ties
from shardkit.nn.fsdp._fairscale_methods import FairscaleMethods, make_fp16_to_fp32_caster, plan_reduce_channels
from shardkit.nn.fsdp._names import clean_members, clean_named_modules
from shardkit.nn.fsdp._state_dict_methods import StateDictMethods
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.forward_methods import ForwardMethods
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import BackwardPrefetch, CPUOffload, ProcessGroupName, policies_from_args
from shardkit.nn.fsdp.runtime import TrainingState, Unit, eager, make_input_caster


class FullyShardedDataParallel(FairscaleMethods, StateDictMethods, ForwardMethods, nn.Module):
    """Shard a module's parameters, gradients and optimizer state across a process group (ZeRO-3).

    Each rank keeps ``1/world_size`` of every parameter as a flat FP32 shard; ``model.parameters()`` yields only
    these shards, so an optimizer built *after* wrapping steps only them. Full parameters exist only while a
    wrapped unit runs: gathered before its forward (and again before its backward), freed afterwards.
    Gradients are reduce-scattered (averaged) into the shards' ``.grad``.

    Nest instances to bound memory: an inner instance owns its parameters, the outer one the rest. The
    outermost instance to run forward becomes the root; it casts inputs for mixed precision and finishes
    every backward pass.

    The arguments are fairscale 0.4.13's, in its order (positional calls keep their meaning); shardkit's own
    (``backward_prefetch``, ``forward_prefetch``) follow, keyword-only. They are validated here, on every rank,
    before anything changes, and turned into the frozen policies of :mod:`shardkit.nn.fsdp.policies`.

    Args:
        module: the module to wrap; available afterwards as ``.module``.
        process_group: group to shard over (default: the world); a ``DummyProcessGroup(rank=0, size=1)`` runs
            without ``torch.distributed``.
        process_group_reduce_scatter: where gradients are reduce-scattered. ``ProcessGroupName.reduce_scatter``
            (default): a second process group over the same ranks, created at the root's first forward, so
            reductions overlap the next gathers; ``ProcessGroupName.default``: ``process_group`` itself; a
            process group: that group (it must hold the same ranks; one of another size is ignored with a
            warning, as fairscale does).
        reshard_after_forward: free full parameters after forward and gather them again for backward.
        disable_reshard_on_root: the root keeps its full parameters after forward (its backward comes first, so
            they would be gathered again at once). False frees them too, for a root whose backward comes later
            (an FSDP model inside a bigger one).
        mixed_precision: gather and compute in ``compute_dtype`` (default float16) with FP32 master shards.
        fp32_reduce_scatter: reduce gradients in FP32 under mixed precision.
        flatten_parameters: one flat tensor per (dtype, requires_grad) per unit; False shards each parameter.
        move_params_to_cpu: keep FP32 shards and their gradients in CPU memory (pinned when computing on CUDA);
            the optimizer then steps on CPU. Full parameters are still gathered on ``compute_device``.
        compute_dtype: dtype of full parameters during compute (enables mixed precision when 16-bit).
        buffer_dtype: dtype floating-point buffers are cast to (default: ``compute_dtype`` under mixed precision).
        move_grads_to_cpu: must match parameter offload (gradients live beside their shards).
        bucket_cap_mb: accepted, no effect: each flat parameter is already reduced in one collective, so there
            are no small tensors to bucket (fairscale's buckets only batch those).
        compute_device: where full parameters are gathered (default: the parameters' device; CUDA under offload
            when available).
        no_broadcast_optim_state: :meth:`gather_full_optim_state_dict` does not gather this unit's optimizer
            state; the recipient's own state is used (complete when the unit is sharded over one rank, as MoE
            experts are; otherwise its ids are listed under ``uncollected_local_ids`` for the caller to fill in).
        state_dict_device: where full state dicts are materialised.
        clear_autocast_cache: call ``torch.clear_autocast_cache()`` after this unit's forward, so autocast's
            cached low-precision weight copies do not pile up across units.
        force_input_to_fp32: in full precision, cast float16 inputs of this unit to float32 (e.g. for
            SyncBatchNorm under autocast); no effect under mixed precision, where inputs get the compute dtype.
        verbose: ``repr`` lists every setting.
        cpu_offload: ``True`` (fairscale's deprecated alias of ``move_params_to_cpu``) or
            ``CPUOffload(offload_params=True)`` (torch's spelling).
        state_dict_on_rank_0_only: :meth:`state_dict` returns the full state dict on global rank 0 only and
            ``{}`` elsewhere (no copies there); every rank must still call it, since all take part in the gathers.
        gradient_predivide_factor: divide gradients by this before the reduction and by ``world_size / factor``
            after it, so the result is still the average (a factor near ``sqrt(world_size)`` keeps 16-bit sums
            from overflowing or underflowing). None: shardkit divides 16-bit gradients before and FP32 ones after.
        allow_reset_parameters: let :meth:`reset_parameters` re-initialise the wrapped module (with its full
            parameters, written back to the shards); otherwise it raises.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` starts gathering the next unit (in backward order)
            in this unit's pre-backward hook, so the gather overlaps this unit's gradient computation, at the
            cost of one more unit's full parameters in memory; ``BACKWARD_POST`` starts it once this unit's
            gradients are out (less overlap, no extra memory); None (default) gathers each unit when it starts.
        forward_prefetch: from the second step on, start gathering the next unit (in the previous forward's
            order) when a unit starts its forward. Prefetching never changes results; at most one unit is
            gathered ahead of its use.

    Notes:
        - Original parameters hold values only during forward/backward and inside :meth:`summon_full_params`;
          between steps ``model.module.fc.weight`` is a placeholder with the right shape, dtype and device and
          no memory (``print(model)`` works; arithmetic on it raises, pointing to ``summon_full_params``).
        - Methods other than forward that run the model (``generate()``): :meth:`register_forward_method`.
        - ``torch.compile(model)`` compiles the compute between the units' hooks, which run eagerly (a graph
          break at each unit); ``fullgraph=True`` is refused.
        - ``state_dict()``, ``load_state_dict()``, ``summon_full_params()`` and the optimizer-state methods must
          be called on every rank; a call on some ranks only raises (see :mod:`shardkit.nn.fsdp.collective_calls`).
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
        process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_grads_to_cpu: Optional[bool] = None,
        bucket_cap_mb: int = 25,
        compute_device: Optional[Union[torch.device, str, int]] = None,
        no_broadcast_optim_state: Optional[bool] = False,
        state_dict_device: Optional[Union[torch.device, str]] = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: Union[bool, CPUOffload, None] = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: Optional[float] = None,
        allow_reset_parameters: bool = False,
        *,
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
            process_group_reduce_scatter=process_group_reduce_scatter,
            disable_reshard_on_root=disable_reshard_on_root,
            no_broadcast_optim_state=no_broadcast_optim_state,
            clear_autocast_cache=clear_autocast_cache,
            force_input_to_fp32=force_input_to_fp32,
            verbose=verbose,
            state_dict_on_rank_0_only=state_dict_on_rank_0_only,
            gradient_predivide_factor=gradient_predivide_factor,
            allow_reset_parameters=allow_reset_parameters,
        )
        group = resolve_group(process_group, "FullyShardedDataParallel")
        policies = self._check_reduce_group(policies, group)
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
        elif policies.mixed_precision.force_input_to_fp32:
            self._unit.cast_inputs = make_fp16_to_fp32_caster()
        #: Original dtypes of floating-point buffers cast for mixed precision (clean name -> dtype), root only.
        self.buffer_original_dtypes: dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------ state (settings: FairscaleMethods)
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
        return self._forward_with(self.module, args, kwargs)

    def _forward_with(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``fn`` (the wrapped module or one of its registered methods) as this unit's forward."""
        self._lazy_init()
        if self._unit.forward_inside_summon():
            return fn(*args, **kwargs)  # the summoned full parameters are in place: nothing to gather or free
        compiling = torch.compiler.is_compiling()
        args, kwargs = self._unit.pre_forward(args, kwargs, not compiling)  # guarded unless compiling
        if compiling:
            # No try block under torch.compile: dynamo cannot resume after a graph break inside one, and nested
            # units break the graph at their (eager) hooks. A forward that raises is undone at the next one.
            output = fn(*args, **kwargs)
        else:
            try:
                output = fn(*args, **kwargs)
            except BaseException:
                # e.g. a user error, or activation checkpointing stopping a recomputation early on purpose
                self._unit.forward_failed()
                raise
        output = self._unit.post_forward(output)
        if self._policies.mixed_precision.clear_autocast_cache:
            torch.clear_autocast_cache()
        return output

    @eager
    def _lazy_init(self) -> None:
        """At the first forward of the outermost instance: mark it root, mark nested instances non-root."""
        unit = self._unit
        if unit.is_root is not None:
            return
        # Checked before anything changes: units sharing a process group must agree on its reduce channel.
        channel_plan = plan_reduce_channels(
            [(p, m) for p, m in clean_named_modules(self, _is_unit) if isinstance(m, FullyShardedDataParallel)]
        )
        unit.is_root, unit.root, unit.units = True, None, []
        unit.name = f"<root {type(self.module).__name__}>"
        for path, module in clean_named_modules(self, _is_unit):
            if isinstance(module, FullyShardedDataParallel):
                if module is not self:
                    module._unit.is_root, module._unit.root, module._unit.units = False, unit, []
                    module._unit.name = path
                unit.units.append(module._unit)
        # Every rank runs the root's first forward at the same point: the one moment to create process groups.
        unit.comm = CommContext(channel_plan())
        self._cast_buffers()

    def _cast_buffers(self) -> None:
        # A buffer takes the buffer dtype of the innermost unit holding it (None: left as it is), so a
        # full-precision unit inside a mixed-precision root (auto_wrap_bn's BatchNorms) keeps FP32 statistics.
        dtype_of: dict[int, Optional[torch.dtype]] = {}
        for _, unit in clean_named_modules(self, _is_unit):
            if isinstance(unit, FullyShardedDataParallel):
                dtype_of.update((id(m), unit.buffer_dtype) for m in unit.module.modules())
        for path, module in clean_named_modules(self, _is_unit):
            dtype = dtype_of.get(id(module))
            for name, buf in module._buffers.items():
                if dtype is not None and buf is not None and buf.is_floating_point() and buf.dtype != dtype:
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
            if name in self.__dict__.get("_forward_methods", ()):
                return functools.partial(self.call_forward_method, name)
            return getattr(module, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (when it is a container such as ``nn.Sequential``)."""
        return self.module.__getitem__(key)  # type: ignore[operator]

    def extra_repr(self) -> str:
        text = (
            f"world_size={self.world_size}, flatten_parameters={self.flatten_parameters}, "
            f"reshard_after_forward={self.reshard_after_forward}, mixed_precision={self.mixed_precision}"
        )
        return text + self._verbose_repr() if self._policies.verbose else text

    # ------------------------------------------------------------------ full parameters
    @contextlib.contextmanager
    def summon_full_params(
        self, recurse: bool = True, volatile: bool = False, *, writeback: Optional[bool] = None
    ) -> Iterator[None]:
        """Gather full-precision parameters and expose them under their original names inside the block.

        Unless ``volatile`` (fairscale's name; ``writeback=False`` is the same) the values (edited in place or
        reassigned, same shape) are copied back into the shards on exit; every rank keeps its own part, so edits
        should agree across ranks. ``recurse=False`` gathers only this unit's own parameters. Not allowed inside
        forward or backward. Example::

            with model.summon_full_params():
                model.module.fc.weight.mul_(0.5)
            with model.summon_full_params(volatile=True):   # read only: nothing is copied back
                snapshot = {n: p.clone() for n, p in model.named_parameters()}
        """
        if writeback is None:
            writeback = not volatile
        elif writeback and volatile:
            raise ValueError(
                "summon_full_params(volatile=True, writeback=True) contradict each other: volatile=True means no "
                "writeback; pass only one of them"
            )
        if self._unit.state != TrainingState.SUMMON_FULL_PARAMS:
            every_rank_calls(self.process_group, "summon_full_params()")
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
                if fsdp._unit.group.is_summoned():
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
