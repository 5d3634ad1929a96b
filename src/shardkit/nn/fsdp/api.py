"""``FullyShardedDataParallel``: the public ZeRO-3 wrapper (fairscale's arguments, shardkit's internals).

What a unit *is* (its run-time state, settings and names) lives in the base class,
:class:`~shardkit.nn.fsdp.unit_module.UnitModule`; this class adds what it *does*: construction, forward,
gradient sync and clipping. It inherits the rest, built on that base class so those layers never import this one:
``summon_full_params`` and ``reset_parameters`` from :class:`~shardkit.nn.fsdp.full_params.FullParamsMethods`,
the state-dict methods (full, local, DCP-sharded, optimizer state) from
:class:`~shardkit.nn.fsdp.state_dict.methods.StateDictMethods`. The root's first-forward set-up is
:func:`~shardkit.nn.fsdp.root.init_root`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike, group_rank, group_size
from shardkit.distributed.hybrid import HybridSpec, agree_across_nodes
from shardkit.distributed.model_check import check_same_model
from shardkit.nn import optimizer_order
from shardkit.nn.fsdp import grad_norm, hf_models, ties
from shardkit.nn.fsdp.forward_methods import check_forward_method
from shardkit.nn.fsdp.full_params import FullParamsMethods
from shardkit.nn.fsdp.hybrid import resolve_unit_groups
from shardkit.nn.fsdp.input_cast import make_input_mover
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import (
    BackwardPrefetch,
    CPUOffload,
    ProcessGroupName,
    ShardingStrategy,
    policies_from_args,
)
from shardkit.nn.fsdp.reduce_channels import resolve_reduce_group
from shardkit.nn.fsdp.root import init_root
from shardkit.nn.fsdp.runtime import TrainingState, Unit, eager, make_fp16_to_fp32_caster, make_input_caster
from shardkit.nn.fsdp.state_dict.methods import StateDictMethods
from shardkit.nn.fsdp.unit_module import UnitModule


class FullyShardedDataParallel(FullParamsMethods, StateDictMethods):
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
        module: the module to wrap; available afterwards as ``.wrapped_module``, and as ``.module`` at
            fairscale's level (with ``flatten_parameters``, a view whose ``.module`` is the module; see
            :attr:`~shardkit.nn.fsdp.unit_module.UnitModule.module`).
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
        - Methods other than forward that run the model: :meth:`register_forward_method`. A Hugging Face
          model's ``generate()`` is routed without registering, and ``model.device``, ``model.dtype`` and
          ``num_parameters()`` answer as the unwrapped model (see :mod:`shardkit.nn.fsdp.hf_models`).
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
        # Every argument but module and process_group is a setting its policy's builder reads by name
        # (policies_from_args refuses one that no builder reads): no other place lists them.
        settings = {name: value for name, value in locals().items() if name not in _NOT_SETTINGS}
        super().__init__()
        group, replica_group, sharding_strategy = resolve_unit_groups(
            process_group, sharding_strategy, reshard_after_forward
        )
        policies = policies_from_args(
            {**settings, "sharding_strategy": sharding_strategy, "replica_group": replica_group}
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
        originals = optimizer_order.parameters_by_id(module)
        param_group = ParamGroup.build(
            self, module, group, self.rank, self.world_size, policies, _is_unit, label, nested
        )
        optimizer_order.remember_replaced(originals, module, label)  # an optimizer over them is refused at step()
        ties.claim(self, module, tied)
        self.add_module("module", module)  # read back as .wrapped_module, and .module at fairscale's level
        self._unit = Unit(param_group, policies, label)
        if policies.mixed_precision.param_dtype is not None:
            # Every mixed-precision unit casts its floating-point inputs (a no-op below a mixed-precision root),
            # so a mixed-precision unit inside a full-precision root still gets inputs of its compute dtype.
            self._unit.cast_inputs = make_input_caster(policies.mixed_precision.param_dtype)
        elif policies.mixed_precision.force_input_to_fp32:
            self._unit.cast_inputs = make_fp16_to_fp32_caster()
        if policies.offload.offload_params and param_group.handles:
            # Offload chose the compute device (the rank's GPU when there is one): bring the batch there too.
            cast, move = self._unit.cast_inputs, make_input_mover(param_group.handles[0].compute_device)
            self._unit.cast_inputs = lambda tree: cast(move(tree))
        #: Original dtypes of floating-point buffers cast for mixed precision (clean name -> dtype), root only.
        self.buffer_original_dtypes: dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_with(self.wrapped_module, args, kwargs)

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
        init_root(self)

    # ------------------------------------------------------------------ attributes of the wrapped module
    def __getattr__(self, name: str) -> Any:
        """Fall back to the wrapped module's attributes (``fsdp.get_input`` reaches ``fsdp.module.get_input``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            if name in self.__dict__.get("_forward_methods", ()) or hf_models.routed_by_default(module, name):
                return functools.partial(self.call_forward_method, name)
            if name in hf_models.READS_PARAMETERS and hf_models.is_transformers_model(module):
                return hf_models.read_with_params_listed(self, module, name)  # model.device, num_parameters()
            return getattr(module, name)

    # ------------------------------------------------------------------ full parameters
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
        method = getattr(self.wrapped_module, method_name)
        self._lazy_init()
        listed: Any = contextlib.nullcontext()
        if hf_models.is_transformers_model(self.wrapped_module):  # generate() reads self.device
            listed = hf_models.original_params_listed(self)
        if self._unit.state == TrainingState.SUMMON_FULL_PARAMS:
            with torch.no_grad(), listed:  # inference on the summoned parameters: their gradients would be lost
                return method(*args, **kwargs)
        with listed:
            return self._forward_with(method, args, kwargs)


#: Constructor arguments that are not settings of a policy (``__class__``: the cell ``super()`` reads).
_NOT_SETTINGS = frozenset({"self", "module", "process_group", "__class__"})


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, UnitModule)
