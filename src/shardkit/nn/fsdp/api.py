"""``FullyShardedDataParallel``: the public ZeRO-3 wrapper (fairscale's arguments, shardkit's internals).

One class, built by composition as torch's FSDP2 is (module state -> parameter group -> parameter): what a unit
*is* (its run-time state through ``fsdp_unit``, fairscale's settings, clean names) comes from
:class:`~shardkit.nn.fsdp.unit_module.UnitModule`, the type the lower layers walk; this class adds construction,
forward and gradients, and holds the :class:`~shardkit.nn.fsdp.forward_methods.ForwardRunner` its forwards
delegate to. ``summon_full_params``, ``apply`` and ``reset_parameters`` hand over to
:mod:`~shardkit.nn.fsdp.full_params`; the state-dict methods check that every rank calls them
(:mod:`~shardkit.nn.fsdp.collective_calls`) and hand over to the functions of :mod:`shardkit.nn.fsdp.state_dict`.
The root's first-forward set-up is :func:`~shardkit.nn.fsdp.root.init_root`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike, group_rank, group_size
from shardkit.distributed.hybrid import HybridSpec
from shardkit.nn import optimizer_order
from shardkit.nn._torch_private import IncompatibleKeys
from shardkit.nn.combinations import refuse_ddp_around
from shardkit.nn.fsdp import full_params, grad_norm, ties
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.forward_methods import ForwardRunner
from shardkit.nn.fsdp.hybrid import resolve_unit
from shardkit.nn.fsdp.input_cast import unit_input_caster
from shardkit.nn.fsdp.param_group import ParamGroup
from shardkit.nn.fsdp.policies import (
    BackwardPrefetch,
    CPUOffload,
    ProcessGroupName,
    ShardingStrategy,
)
from shardkit.nn.fsdp.runtime import TrainingState, Unit
from shardkit.nn.fsdp.state_dict import consolidate, full, sharded
from shardkit.nn.fsdp.state_dict import optim as optim_module
from shardkit.nn.fsdp.unit_module import UnitModule


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
        group, policies = resolve_unit(module, process_group, settings)  # may raise; nothing changed yet
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
        handles = param_group.handles
        offload_device = handles[0].compute_device if policies.offload.offload_params and handles else None
        mp = policies.mixed_precision
        self._unit.cast_inputs = unit_input_caster(mp.param_dtype, mp.force_input_to_fp32, offload_device)
        #: Original dtypes of floating-point buffers cast for mixed precision (clean name -> dtype), root only.
        self.buffer_original_dtypes: dict[str, torch.dtype] = {}
        self._forward = ForwardRunner(self)  # forward and the registered forward methods delegate to it

    # ------------------------------------------------------------------ forward (ForwardRunner)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward.run(self.wrapped_module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        """Fall back to the wrapped module's attributes (``fsdp.get_input`` reaches ``fsdp.module.get_input``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module, runner = self.__dict__.get("_modules", {}).get("module"), self.__dict__.get("_forward")
            if module is None or runner is None:  # during construction
                raise
            return runner.attribute(module, name)

    # ------------------------------------------------------------------ full parameters (shardkit.nn.fsdp.full_params)
    def summon_full_params(
        self, recurse: bool = True, volatile: bool = False, *, writeback: Optional[bool] = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gather full-precision parameters and expose them under their original names inside the block.

        Unless ``volatile`` (fairscale's name; ``writeback=False`` is the same) the values (edited in place or
        reassigned, same shape) are copied back into the shards on exit; every rank keeps its own part, so edits
        should agree across ranks. ``recurse=False`` gathers only this unit's own parameters. Not allowed inside
        forward or backward; every rank enters the block. Example::

            with model.summon_full_params():
                model.module.fc.weight.mul_(0.5)
            with model.summon_full_params(volatile=True):   # read only: nothing is copied back
                snapshot = {n: p.clone() for n, p in model.named_parameters()}
        """
        return full_params.summon(self, recurse, volatile, writeback)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with full parameters, written back to the shards (e.g. custom initialisation)."""
        full_params.apply(self, fn)
        return self

    def reset_parameters(self) -> None:
        """Re-initialise the wrapped module (``module.reset_parameters()`` on its full parameters, written back
        to the shards). Only with ``allow_reset_parameters=True``: re-initialising after sharding gives
        different values than before wrapping (random streams differ), so fairscale makes it opt-in too."""
        full_params.reset(self)

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
        every rank. Example::

            torch.save(model.state_dict(), "full.pt")
        """
        given = {"destination": destination, "prefix": prefix, "keep_vars": keep_vars, **kwargs}
        options = full.state_dict_arguments("state_dict", args, given, positional=False)
        every_rank_calls(self.process_group, "state_dict()")
        return full.state_dict(self, **options)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> IncompatibleKeys:
        """Load a full state dict (as returned by :meth:`state_dict` or by the unwrapped model); every rank."""
        every_rank_calls(self.process_group, "load_state_dict()")
        return full.load_state_dict(self, state_dict, strict, assign)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards and buffers, for saving and loading at the same world size and wrapping.

        Takes ``nn.Module.state_dict``'s ``destination``, ``prefix`` and ``keep_vars`` (by keyword or in that
        order), as fairscale's does: keys get ``prefix``, entries are added to ``destination`` (returned), and
        ``keep_vars=True`` keeps the shards as the parameters themselves. No communication. Example::

            torch.save(model.local_state_dict(), f"shard{rank}.pt")
            sub = model.local_state_dict(destination={}, prefix="model.")   # as a parent's state_dict asks
        """
        return full.local_state_dict(self, **full.state_dict_arguments("local_state_dict", args, kwargs))

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load what :meth:`local_state_dict` returned on this rank."""
        return full.load_local_state_dict(self, state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """How this rank's :meth:`local_state_dict` maps onto the full model, for :meth:`consolidate_shard_weights`."""
        return consolidate.local_metadata_dict(self)

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The full state dict from every rank's :meth:`local_state_dict` and :meth:`local_metadata_dict`, offline
        (no processes, no model; see :mod:`shardkit.nn.fsdp.state_dict.consolidate`)."""
        return consolidate.consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers, strict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Per original parameter a row-sharded DTensor, for ``torch.distributed.checkpoint.save``. Example::

        torch.distributed.checkpoint.save({"model": model.sharded_state_dict()}, checkpoint_id=path)
        """
        every_rank_calls(self.process_group, "sharded_state_dict()")
        return sharded.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load what ``torch.distributed.checkpoint.load`` filled in from :meth:`sharded_state_dict`, at any
        world size."""
        every_rank_calls(self.process_group, "load_sharded_state_dict()")
        return sharded.load_sharded_state_dict(self, state_dict, strict=strict)

    def gather_full_optim_state_dict(self, optim: Any, **ignored: Any) -> Optional[dict[str, Any]]:
        """The optimizer state for the full, unflattened model (see :mod:`shardkit.nn.fsdp.state_dict`).

        ``optim`` is the torch optimizer built from ``model.parameters()``, or a wrapper around it with
        ``param_groups`` and ``state_dict()``. ``recipient_rank`` (default 0) is the one keyword used;
        fairscale's other keywords are ignored, as there. A wrong ``optim`` is refused on every rank.
        """
        optim_module.every_rank_checks_optim(self.process_group, optim)
        return optim_module.gather_full_optim_state_dict(self, optim, ignored.get("recipient_rank", 0))

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: Optional[torch.optim.Optimizer] = None
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, ready for ``optim.load_state_dict``."""
        return optim_module.get_shard_from_optim_state_dict(self, full_optim_state_dict, optim)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Reached only when an *unwrapped* parent's load_state_dict recurses into this unit (auto_wrap case).
        full.load_from_state_dict_hook(self, state_dict, prefix, *args)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        # torch's DistributedDataParallel reads this of the module it wraps, at construction, before it broadcasts
        # anything: the one point where DDP(FSDP(model)) can be refused. Anyone else finds no such attribute.
        refuse_ddp_around(inspect.currentframe())
        raise AttributeError("_ddp_params_and_buffers_to_ignore")

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for backward passes inside the block.

        Costs memory: every unit keeps an *unsharded* gradient (master dtype) until the next backward outside
        the block reduce-scatters the sum, so peak memory grows by the full model's gradient size, as in DDP.
        """
        units = self.fsdp_units()
        previous = [u.sync_grads for u in units]
        for u in units:
            u.sync_grads = False
        try:
            with optimizer_order.refuse_steps_inside(self.parameters(), "FullyShardedDataParallel"):
                yield
        finally:
            for u, before in zip(units, previous):
                u.sync_grads = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every unit by their true global norm; call on the root, on every rank.

        Handles units sharded over different groups (e.g. experts in a size-one group). Returns the norm
        before clipping.
        """
        self._forward.init_root()
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
        self._forward.register(method_name)

    def call_forward_method(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``self.module.<method_name>(*args, **kwargs)`` as this unit's forward (what ``self.<method_name>``
        does once registered)."""
        return self._forward.call(method_name, *args, **kwargs)


#: Constructor arguments that are not settings of a policy (``__class__``: the cell ``super()`` reads).
_NOT_SETTINGS = frozenset({"self", "module", "process_group", "__class__"})


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, UnitModule)
