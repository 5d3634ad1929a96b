"""``FullyShardedDataParallel``: the public ZeRO-3 wrapper (fairscale's arguments, shardkit's internals).

What a unit *is* (its run-time state, settings and names) lives in the base class,
:class:`~shardkit.nn.fsdp.unit_module.UnitModule`; this class adds what it *does*: construction, forward, full
parameters, gradient sync and clipping, and the state dicts (built by :mod:`shardkit.nn.fsdp.state_dict` on the
base class, so that layer never imports this one).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from shardkit.distributed.groups import GroupLike, group_rank, group_size
from shardkit.distributed.model_check import check_same_model
from shardkit.nn.fsdp import grad_norm, ties
from shardkit.nn.fsdp import state_dict as sd
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.forward_methods import check_forward_method
from shardkit.nn.fsdp.hybrid import resolve_unit_groups
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import (
    BackwardPrefetch,
    CPUOffload,
    ProcessGroupName,
    ShardingStrategy,
    policies_from_args,
)
from shardkit.nn.fsdp.reduce_channels import plan_reduce_channels, resolve_reduce_group
from shardkit.nn.fsdp.runtime import TrainingState, Unit, eager, make_fp16_to_fp32_caster, make_input_caster
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules
from shardkit.optim.zero1.hybrid import HybridSpec, agree_across_nodes


class FullyShardedDataParallel(UnitModule):
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
            without ``torch.distributed``. For hybrid sharding, the nodes: an ``(intra_node_group,
            inter_node_group)`` pair, a 2-D ``DeviceMesh`` (dim 0 across nodes) or a ``Topology``; without one,
            hybrid strategies find the nodes from torchrun's ``LOCAL_WORLD_SIZE``.
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
        sharding_strategy: torch FSDP's :class:`ShardingStrategy`. ``FULL_SHARD`` (what
            ``reshard_after_forward=True`` means), ``SHARD_GRAD_OP`` (``reshard_after_forward=False``),
            ``NO_SHARD`` (DDP-like: full parameters on every rank, gradients all-reduced), ``HYBRID_SHARD`` /
            ``_HYBRID_SHARD_ZERO2`` (FULL_SHARD / SHARD_GRAD_OP inside each node; each reduced gradient shard
            is all-reduced across nodes; parameter memory per rank is 1/processes per node). None: from
            ``reshard_after_forward`` (hybrid when ``process_group`` describes nodes). The strategy decides
            over the default ``reshard_after_forward=True``; an explicit ``reshard_after_forward=False`` with a
            strategy that reshards is refused. Under hybrid sharding ``process_group``/``world_size`` are the
            node's (state dicts gather inside the node); :attr:`replica_group` holds the other nodes' ranks.

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

    Hybrid sharding (shard inside each node, replicate across nodes; nodes from torchrun's LOCAL_WORLD_SIZE)::

        model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        model = FSDP(model, process_group=(intra_node_group, inter_node_group),
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)

    Overlapping communication, and shards kept in CPU memory::

        blocks = [FSDP(b, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True) for b in blocks]
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True))   # optimizer then steps on CPU
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Union[GroupLike, HybridSpec, None] = None,
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
        sharding_strategy: Optional[ShardingStrategy] = None,
    ) -> None:
        super().__init__()
        group, replica_group, sharding_strategy = resolve_unit_groups(
            process_group, sharding_strategy, reshard_after_forward
        )
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
            sharding_strategy=sharding_strategy,
            replica_group=replica_group,
        )
        policies = resolve_reduce_group(policies, group)
        if replica_group is not None:  # the replicas must hold the same model too (nothing changed yet)
            agree_across_nodes(
                lambda g, err: check_same_model(module, g, "FullyShardedDataParallel", local_error=err),
                group,
                replica_group,
                None,
            )
        self.process_group = group
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        label = type(module).__name__
        nested = [m.fsdp_unit.group for m in module.modules() if isinstance(m, UnitModule)]
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

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The unit's :class:`ShardingStrategy` (torch FSDP's attribute)."""
        return self._policies.sharding.strategy

    @property
    def replica_group(self) -> Optional[GroupLike]:
        """The ranks holding the same shards as this one (hybrid sharding: the same local rank on every node;
        NO_SHARD: every rank), over which reduced gradient shards are all-reduced; None without replicas.
        ``process_group`` is the shard group, so a checkpoint counts ``world // world_size`` replicas."""
        return self._policies.reduce.replica_group

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
        tree = [(path, m) for path, _, m in walk_modules(self) if isinstance(m, UnitModule)]
        root_name = f"<root {type(self.module).__name__}>"
        channel_plan = plan_reduce_channels([(path or root_name, m.fsdp_unit) for path, m in tree])
        unit.is_root, unit.root, unit.units = True, None, []
        unit.name = root_name
        for path, module in tree:
            if module is not self:
                module.fsdp_unit.join_tree(unit, path)
            unit.units.append(module.fsdp_unit)
        # Every rank runs the root's first forward at the same point: the one moment to create process groups.
        unit.comm = CommContext(channel_plan())
        self._cast_buffers()

    def _cast_buffers(self) -> None:
        # A buffer takes the buffer dtype of the innermost unit holding it (None: left as it is), so a
        # full-precision unit inside a mixed-precision root (auto_wrap_bn's BatchNorms) keeps FP32 statistics.
        dtype_of: dict[int, Optional[torch.dtype]] = {}
        tree = [(path, m) for path, _, m in walk_modules(self)]
        for _, unit in tree:
            if isinstance(unit, UnitModule):
                dtype_of.update((id(m), unit.buffer_dtype) for m in unit.module.modules())
        for path, module in tree:
            dtype = dtype_of.get(id(module))
            for name, buf in module._buffers.items():
                if dtype is not None and buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    self.buffer_original_dtypes[f"{path}.{name}" if path else name] = buf.dtype
                    module._buffers[name] = buf.to(dtype)

    # ------------------------------------------------------------------ attributes of the wrapped module
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
        targets = [m.fsdp_unit for m in self.modules() if isinstance(m, UnitModule)] if recurse else [self._unit]
        entered = []
        try:
            for unit in targets:
                if unit.state == TrainingState.SUMMON_FULL_PARAMS:
                    continue  # already summoned by an enclosing call
                unit.transition("summon")
                entered.append(unit)
                unit.group.summon()
            yield
        finally:
            for unit in reversed(entered):
                if unit.group.is_summoned():
                    unit.group.unsummon(writeback)
                unit.transition("unsummon")

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
        units = [m.fsdp_unit for m in self.modules() if isinstance(m, UnitModule)]
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

    def reset_parameters(self) -> None:
        """Re-initialise the wrapped module (``module.reset_parameters()`` on its full parameters, written back
        to the shards). Only with ``allow_reset_parameters=True``: re-initialising after sharding gives
        different values than before wrapping (random streams differ), so fairscale makes it opt-in too."""
        if not self._policies.allow_reset_parameters:
            raise RuntimeError(
                "reset_parameters() after FullyShardedDataParallel wrapping is not allowed: initialise the module "
                "before wrapping, or pass allow_reset_parameters=True"
            )
        with self.summon_full_params(recurse=True):
            module: Any = self.module  # any module class may define reset_parameters
            module.reset_parameters()

    # ------------------------------------------------------------------ other entry points (generate())
    def register_forward_method(self, method_name: str) -> None:
        """Make ``self.<method_name>(...)`` run the wrapped module's method with this unit's forward logic.

        For entry points that call the module's ``forward`` from inside (Hugging Face's ``generate()``): the
        unit's parameters are gathered for the whole call and freed after it; nested units gather and free
        theirs at each of their forwards. Inside :meth:`summon_full_params` the method runs on the summoned
        parameters, without gradients. The wrapped module is not modified (see
        :mod:`shardkit.nn.fsdp.forward_methods`). Example::

            model.register_forward_method("generate")
            tokens = model.generate(input_ids, max_new_tokens=8)
        """
        check_forward_method(self, method_name)
        registered = self.__dict__.get("_forward_methods", frozenset())
        self.__dict__["_forward_methods"] = registered | {method_name}

    def call_forward_method(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``self.module.<method_name>(*args, **kwargs)`` as this unit's forward (what ``self.<method_name>``
        does once registered)."""
        method = getattr(self.module, method_name)
        if self._unit.state == TrainingState.SUMMON_FULL_PARAMS:
            with torch.no_grad():  # inference on the summoned parameters: their gradients would be lost
                return method(*args, **kwargs)
        return self._forward_with(method, args, kwargs)

    # ------------------------------------------------------------------ state dicts (shardkit.nn.fsdp.state_dict)
    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: Optional[dict[str, Any]] = None,
        prefix: str = "",
        keep_vars: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Full, unflattened state dict with the unwrapped model's keys (see :mod:`shardkit.nn.fsdp.state_dict`).

        Takes ``nn.Module.state_dict``'s keywords (fairscale's signature is ``(*args, **kwargs)``); call on
        every rank.
        """
        _no_more("state_dict", kwargs)
        every_rank_calls(self.process_group, "state_dict()")
        return sd.state_dict(self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a full state dict (as returned by :meth:`state_dict` or by the unwrapped model)."""
        every_rank_calls(self.process_group, "load_state_dict()")
        return sd.load_state_dict(self, state_dict, strict, assign)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards and buffers, for saving and loading at the same world size. fairscale's signature
        forwards its arguments to ``nn.Module.state_dict``; shardkit's local state dict takes none."""
        if args:
            raise TypeError("local_state_dict() takes no positional arguments")
        _no_more("local_state_dict", kwargs)
        return sd.local_state_dict(self)

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
        """Load what :meth:`local_state_dict` returned on this rank."""
        return sd.load_local_state_dict(self, state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """How this rank's :meth:`local_state_dict` maps onto the full model, for :meth:`consolidate_shard_weights`."""
        return sd.local_metadata_dict(self)

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The full state dict from every rank's :meth:`local_state_dict` and :meth:`local_metadata_dict`, offline
        (no processes, no model; see :mod:`shardkit.nn.fsdp.state_dict.consolidate`)."""
        return sd.consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers, strict)

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored: Any) -> Optional[dict[str, Any]]:
        """The optimizer state for the full, unflattened model (see :mod:`shardkit.nn.fsdp.state_dict`).

        ``recipient_rank`` (default 0) is the one keyword used; fairscale's other keywords are ignored, as there.
        """
        every_rank_calls(self.process_group, "gather_full_optim_state_dict()")
        return sd.gather_full_optim_state_dict(self, optim, recipient_rank=ignored.get("recipient_rank", 0))

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: Optional[torch.optim.Optimizer] = None
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, ready for ``optim.load_state_dict``."""
        return sd.get_shard_from_optim_state_dict(self, full_optim_state_dict, optim=optim)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Per original parameter a row-sharded DTensor, for ``torch.distributed.checkpoint.save``.

        Example::

            torch.distributed.checkpoint.save({"model": model.sharded_state_dict()}, checkpoint_id=path)
        """
        every_rank_calls(self.process_group, "sharded_state_dict()")
        return sd.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
        """Load what ``torch.distributed.checkpoint.load`` filled in from :meth:`sharded_state_dict`, at any
        world size."""
        every_rank_calls(self.process_group, "load_sharded_state_dict()")
        return sd.load_sharded_state_dict(self, state_dict, strict=strict)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Reached only when an *unwrapped* parent's load_state_dict recurses into this unit (auto_wrap case).
        sd.load_from_state_dict_hook(self, state_dict, prefix, *args)


def _no_more(method: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"{method}() got unexpected keyword arguments {sorted(kwargs)}")


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, UnitModule)
