"""``smp.DistributedOptimizer``: the user's optimizer, with state dicts that know about pipeline stages.

As in smp, the object returned is the user's optimizer with some methods overridden: an instance of a subclass
of the optimizer's own class (same name) that shares the optimizer's attributes (``param_groups``, ``state``,
``defaults``, hooks) through one ``__dict__``. So ``isinstance(opt, torch.optim.Optimizer)`` holds and LR
schedulers, ``GradScaler.step``, ``add_param_group`` and step hooks work unchanged; the original object and the
returned one are two views of one optimizer (no copy of any state). Overridden: ``state_dict``,
``load_state_dict`` and ``local_state_dict``; ``step`` and ``zero_grad`` are the optimizer's own (parameters a
stage released have no gradient, so the optimizer skips them and never builds state for them).

State dicts use the torch format (parameters by index in ``param_groups`` order), so a full one loads into a
plain optimizer built over the unwrapped model's parameters in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from shardkit.distributed import collectives as C
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.checkpoints import checkpoint as ckpt
from shardkit.modelparallel.checkpoints.sharded_state import ShardedOptimizerState
from shardkit.modelparallel.optimizers import FusedLamb
from shardkit.modelparallel.tp.layers import sliced_parameter_ids

# One subclass per (optimizer class, sharded state), so wrapped optimizers of one class share a type.
_SUBCLASSES: dict[tuple[type, bool], type] = {}


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` (built over the DistributedModel's parameters) for stage-aware state dicts.

    Returns the optimizer itself under a subclass of its class (see the module docstring): it is an instance of
    that class, of ``torch.optim.Optimizer`` and of ``smp.DistributedOptimizer``.

    ``static_loss_scale``, ``dynamic_loss_scale`` and ``dynamic_loss_args`` are smp's FP16 loss-scaling options;
    smp applies them only with ``"fp16": true``. shardkit scales losses with ``smp.amp.GradScaler`` instead, so
    the defaults are accepted and any other value with ``fp16``/``bf16`` is refused (it would otherwise be
    silently ignored). A :class:`~shardkit.modelparallel.optimizers.FusedLamb` gets its global gradient norm
    summed over the replica's stages (each parameter counted once), so its clipping matches single-process
    training; every rank must then call ``step()``.

    Example::

        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        ...
        optimizer.step()
        scheduler.step()
        smp.save({"optimizer": optimizer.local_state_dict()}, "ckpt.pt", partial=True)
    """

    def __new__(
        cls, optimizer: Optional[torch.optim.Optimizer] = None, *args: Any, **kwargs: Any
    ) -> DistributedOptimizer:
        if optimizer is None and cls is not DistributedOptimizer:  # copy.copy rebuilding an instance
            return super().__new__(cls)
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already an smp.DistributedOptimizer; wrap the optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        base = type(optimizer)
        sharded = smp_state.current().config.shard_optimizer_state
        sub = _SUBCLASSES.get((base, sharded))
        if sub is None:
            namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
            bases = (_ShardedStep, DistributedOptimizer, base) if sharded else (DistributedOptimizer, base)
            sub = _SUBCLASSES[(base, sharded)] = type(base.__name__, bases, namespace)
        wrapped: DistributedOptimizer = object.__new__(sub)
        wrapped.__dict__ = optimizer.__dict__  # one optimizer, two views: nothing is copied
        return wrapped

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: Optional[float] = 1.0,
        dynamic_loss_scale: bool = False,
        **dynamic_loss_args: Any,
    ) -> None:
        # Optimizer.__init__ is not called: the attributes are the wrapped optimizer's own (shared __dict__).
        state = smp_state.current()
        _check_precision(self, state.config, static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        self._smp_state = state
        self._smp_inner = optimizer
        self._smp_pending: Optional[dict[str, Any]] = None
        self._smp_sharded: Optional[ShardedOptimizerState] = None
        if isinstance(self, FusedLamb):  # its global gradient norm spans every stage
            if state.config.shard_optimizer_state or state.config.sharded_data_parallel_degree > 1:
                raise ValueError(
                    "FusedLamb's global gradient norm needs every gradient of its parameters, which "
                    "'shard_optimizer_state' and 'sharded_data_parallel_degree' spread over the replicas: use one of "
                    "them or FusedLamb, not both"
                )
            self.set_sum_of_squares(self._sum_over_stages)
        state.optimizer = self
        if state.model is not None and state.model.partitioned:  # built after the first step: shard now
            self.load_pending_state()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)  # a copy keeps smp's attributes along with the optimizer's

    def is_state_sharded(self) -> bool:
        """True when the config's ``shard_optimizer_state`` spreads this optimizer's state over the replicas
        (``self.state`` is then empty; the state dicts gather it)."""
        return bool(self._smp_state.config.shard_optimizer_state)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer as the user built it: the same attributes, its own class's methods (plain torch state
        dicts over every parameter). An optimizer class with its own ``optimizer`` attribute keeps it."""
        own = self.__dict__.get("optimizer")
        return own if own is not None else self.__dict__["_smp_inner"]

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self.__dict__["optimizer"] = value

    # ---- smp's FP16-optimizer names, at their meaning without FP16 master weights ---------------------------

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """smp's FP16 optimizer lists the model parameters of each parameter group here; shardkit keeps no
        separate master copies, so these are the parameters the optimizer updates, group by group."""
        return [list(group["params"]) for group in self.param_groups]

    @property
    def overflow(self) -> bool:
        """smp: True when the last ``step()`` was skipped for an FP16 gradient overflow. shardkit's optimizer does
        no loss scaling (``smp.amp.GradScaler`` skips steps itself), so this is always False."""
        return False

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model (every stage, each parameter once) is at
        most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` over the unpartitioned model; returns that norm.

        smp clips its FP32 master gradients; here the parameters are the masters. Collective over the replica's
        stages: call it on every rank.
        """
        if norm_type != 2.0:
            raise ValueError(f"clip_master_grads supports the 2-norm only, got norm_type={norm_type}")
        sharded = self._sharded_stage()
        if sharded is not None:  # the gradients are shards: the norm is summed over the sharding group
            return sharded.clip(max_norm)
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        device = params[0].grad.device if params else self._device_for_norm()
        norms = [torch.linalg.vector_norm(p.grad.detach(), 2.0).to(device) for p in params]
        squares = torch.stack(norms) ** 2 if norms else torch.zeros(0, device=device)
        total = self._sum_over_stages(params, squares).sqrt()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coefficient.to(p.grad.device))
        return total

    def _sharded_stage(self) -> Any:
        """Under sharded data parallelism after the partition, the model's sharded stage; else None."""
        model = self._smp_state.model
        execution = model.stage_execution if model is not None else None
        return execution.sharded if execution is not None else None

    def _device_for_norm(self) -> torch.device:
        model = self._smp_state.model
        return model.execution_device if model is not None and model.partitioned else torch.device("cpu")

    def _sum_over_stages(self, params: Sequence[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
        """Sum of per-parameter squares over the replica's stages and tensor-parallel ranks, each parameter (each
        slice of a split one) counted once (collective)."""
        smp = self._smp_state
        model = smp.model
        topo = smp.topology
        if model is None or not model.partitioned or topo.mp_size * topo.tp_size == 1 or not smp.distributed:
            return squares.sum()
        mask = torch.tensor(model.first_holder_mask(params), dtype=torch.bool, device=squares.device)
        counted = torch.where(mask, squares, torch.zeros_like(squares))
        if topo.tp_size > 1:  # split slices summed over the TP group; replicated parameters, equal there, once
            split_ids = sliced_parameter_ids(model.module)
            split = torch.tensor([id(p) in split_ids for p in params], dtype=torch.bool, device=squares.device)
            sliced = torch.where(split, counted, torch.zeros_like(counted)).sum().reshape(1).to(model.execution_device)
            C.all_reduce(sliced, group=smp.tp_group, label="smp_global_grad_norm_tp")
            whole = torch.where(split, torch.zeros_like(counted), counted).sum().reshape(1).to(model.execution_device)
            total = sliced + whole
        else:
            total = counted.sum().reshape(1).to(model.execution_device)
        if topo.mp_size > 1:
            C.all_reduce(total, group=smp.mp_group, label="smp_global_grad_norm")
        return total.reshape(()).to(squares.device)

    def _held_indices(self) -> Optional[set[int]]:
        model = self._smp_state.model
        if model is None or not model.partitioned:
            return None
        held = {id(p) for p in model.local_parameters()}
        params = [p for group in self.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in held}

    def local_state_dict(self) -> dict[str, Any]:
        """State of the parameters this stage holds, marked ``_smp_is_partial``.

        With ``shard_optimizer_state`` the stage's state is gathered from its shards first: a collective over
        the data-parallel group (call it on every replica).
        """
        full = super().state_dict()
        held = self._held_indices()
        if self._smp_sharded is not None:
            full["state"] = self._smp_sharded.gathered_state()
        elif held is not None:
            full["state"] = {i: v for i, v in full["state"].items() if i in held}
        full[ckpt.PARTIAL_KEY] = True
        return full

    def state_dict(self) -> dict[str, Any]:
        """State of every stage's parameters, gathered (collective over the replica's stages)."""
        if self._sharded_stage() is not None:
            raise ValueError(
                "optimizer.state_dict(): under sharded data parallelism each rank holds the state of its shards only; "
                "save optimizer.local_state_dict() per rank, or smp.save_checkpoint(..., partial=True)"
            )
        partials = ckpt.gather_partials(self.local_state_dict(), self._smp_state.mp_group, "smp_optimizer_state_dict")
        return ckpt.merge_optimizer_partials(partials)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full or partial (gathered first: collective) state dict; waits for the partition if needed."""
        if ckpt.is_partial(state_dict):
            partials = ckpt.gather_partials(state_dict, self._smp_state.mp_group, "smp_optimizer_load_state_dict")
            full = ckpt.merge_optimizer_partials(partials)
        else:
            full = {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        model = self._smp_state.model
        if model is not None and not model.partitioned:
            # The state waits for the partition (it must know which stage holds what); the hyper-parameters do
            # not, and an LR scheduler stepped or read before the first step must see the loaded ones.
            self._load_hyperparameters(full["param_groups"])
            self._smp_pending = full
            return
        self._load(full)

    def _load_hyperparameters(self, saved_groups: list[dict[str, Any]]) -> None:
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the loaded optimizer state has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}: build the optimizer with the same groups as the one saved"
            )
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def load_pending_state(self) -> None:
        """Right after the partition (the model calls it): shard the optimizer state when the config says so,
        then load a state dict given before the partition."""
        smp = self._smp_state
        model = smp.model
        sharded = self._sharded_stage()
        if sharded is not None:  # the script's parameters became shards: the optimizer steps those
            sharded.adopt_optimizer(self)
        if smp.config.shard_optimizer_state and self._smp_sharded is None and model is not None:
            held = {id(p) for p in model.local_parameters()}
            inner = self._smp_inner
            self._smp_sharded = ShardedOptimizerState(
                # Over the ranks holding the same tensors: under tensor parallelism smp's data-parallel group also
                # holds the other slices of split parameters, which an owner's broadcast would overwrite.
                self.param_groups,
                held,
                type(inner),
                dict(self.defaults),
                smp.rdp_group,
            )
        if self._smp_pending is not None:
            pending, self._smp_pending = self._smp_pending, None
            self._load(pending if sharded is None else sharded.cut_whole_state(pending, self))

    def _load(self, full: dict[str, Any]) -> None:
        if self._smp_sharded is not None:
            self._load_hyperparameters(full["param_groups"])
            self._smp_sharded.load(full)
            return
        held = self._held_indices()
        state = full["state"] if held is None else {i: v for i, v in full["state"].items() if int(i) in held}
        super().load_state_dict({"state": state, "param_groups": full["param_groups"]})


def _sharded_step(self: DistributedOptimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
    """With ``shard_optimizer_state``: each replica updates the parameters it owns, then shares them (collective
    over the data-parallel group: every rank must call it)."""
    sharded = self.__dict__.get("_smp_sharded")
    if sharded is None:  # before the partition no parameter has a gradient: nothing to update
        return closure() if closure is not None else None
    return sharded.step(self.param_groups, closure, **kwargs)


class _ShardedStep:
    """``step`` of a DistributedOptimizer whose state is sharded; runs the optimizer's step hooks once, as
    torch's own ``step`` wrapper does."""

    step = torch.optim.Optimizer.profile_hook_step(_sharded_step)
    setattr(step, "hooked", True)  # noqa: B010  (what torch's own step wrapper sets: never wrap it again)


def _check_precision(
    optimizer: torch.optim.Optimizer,
    config: Any,
    static_loss_scale: Optional[float],
    dynamic_loss_scale: bool,
    dynamic_loss_args: dict[str, Any],
) -> None:
    """Refuse what smp's FP16 optimizer would do and shardkit would silently not (see the class docstring)."""
    low = "fp16" if config.fp16 else "bf16" if config.bf16 else None
    if low is None:
        return  # smp applies the loss-scaling options only under fp16/bf16: no effect, as there
    if dynamic_loss_scale or static_loss_scale not in (1.0, None) or dynamic_loss_args:
        raise ValueError(
            f"smp.DistributedOptimizer's loss-scaling options are not supported with '{low}': true; scale the loss "
            "with smp.amp.GradScaler (scaler.scale(loss) in the step, scaler.step(optimizer) after it)"
        )
    halves = [p.dtype for group in optimizer.param_groups for p in group["params"] if p.dtype in _LOW_DTYPES]
    if halves:
        raise ValueError(
            f"the smp config sets '{low}': true and the optimizer holds {halves[0]} parameters: smp would keep FP32 "
            "master weights for them, shardkit does not. Build the model in float32 and run the step under "
            "torch.autocast with smp.amp.GradScaler (parameters and optimizer state stay FP32)"
        )
    warnings.warn(
        f"smp config '{low}': true does not convert the model in shardkit: parameters and optimizer state stay FP32, "
        "and the step computes in the precision the script asks for (use torch.autocast with smp.amp.GradScaler "
        "for mixed precision)",
        stacklevel=3,
    )


_LOW_DTYPES = (torch.float16, torch.bfloat16)
