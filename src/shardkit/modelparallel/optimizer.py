"""``smp.DistributedOptimizer``: the user's optimizer, with state dicts that know about pipeline stages.

As in smp, the object returned is the user's optimizer with some methods overridden: an instance of a subclass
of the optimizer's own class (same name) that shares the optimizer's attributes (``param_groups``, ``state``,
``defaults``, hooks) through one ``__dict__``. So ``isinstance(opt, torch.optim.Optimizer)`` holds and LR
schedulers, ``GradScaler.step``, ``add_param_group`` and step hooks work unchanged; the original object and the
returned one are two views of one optimizer (no copy of any state). Overridden: ``state_dict``,
``load_state_dict`` and ``local_state_dict``; ``step`` and ``zero_grad`` are the optimizer's own (parameters a
stage released have no gradient, so the optimizer skips them and never builds state for them), except under
``"fp16"``/``"bf16"``, where they also move gradients into the FP32 masters and the masters into the model (see
:mod:`~.precision.fp16_optimizer`; ``param_groups`` then hold the masters, so the original object updates the
masters only).

State dicts use the torch format (parameters by index in ``param_groups`` order), so a full one loads into a
plain optimizer built over the unwrapped model's parameters in the same order. Under fp16/bf16 each parameter's
entry also holds its FP32 master (``"fp32_master_param"``) and a top-level ``"loss_scaler"`` the scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from shardkit.distributed import collectives as C
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.building.build import execution_device
from shardkit.modelparallel.checkpoints import checkpoint as ckpt
from shardkit.modelparallel.checkpoints.sharded_state import ShardedOptimizerState
from shardkit.modelparallel.optimizer_steps import MixedPrecisionStep, ShardedStep
from shardkit.modelparallel.optimizers import FusedLamb
from shardkit.modelparallel.precision.fp16_optimizer import (
    SCALER_KEY,
    MixedPrecision,
    check_precision,
    low_precision_dtype,
)
from shardkit.modelparallel.precision.loss_scaler import LossScaleOptions
from shardkit.modelparallel.tp.layers import sliced_parameter_ids

# One subclass per (optimizer class, sharded state, FP16/BF16 masters), so wrapped optimizers of one class share a
# type.
_SUBCLASSES: dict[tuple[type, bool, bool], type] = {}


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` (built over the DistributedModel's parameters) for stage-aware state dicts.

    Returns the optimizer itself under a subclass of its class (see the module docstring): it is an instance of
    that class, of ``torch.optim.Optimizer`` and of ``smp.DistributedOptimizer``.

    With ``"fp16": true`` or ``"bf16": true`` in the smp config it is smp's FP16 optimizer (see
    :mod:`~.precision.fp16_optimizer`): ``param_groups`` hold FP32 master copies of the model's low-precision parameters
    (``fp16_groups`` lists those), ``step()`` updates the masters and rounds them into the model, and under fp16
    the loss is scaled: ``static_loss_scale``, or ``dynamic_loss_scale=True`` with smp's ``dynamic_loss_args``
    (``init_scale``, ``scale_factor``, ``scale_window``, ``min_scale``, ``delayed_shift``,
    ``consecutive_hysteresis``; given as keywords or as one ``dynamic_loss_args={...}`` dict). A step with an
    inf/NaN gradient on any rank is skipped on every rank (``overflow`` is then True) and the scale lowered. Without
    these keys the loss-scaling options have no effect, as in smp. Create the ``DistributedModel`` first (it casts
    the model), and call ``step()`` on every rank. A :class:`~shardkit.modelparallel.optimizers.FusedLamb` gets its
    global gradient norm
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
        config = smp_state.current().config
        sharded, mixed = config.shard_optimizer_state, low_precision_dtype(config) is not None
        sub = _SUBCLASSES.get((base, sharded, mixed))
        if sub is None:
            namespace = {
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "_smp_base": base,  # the user's optimizer class: whose step and zero_grad the step classes call
            }
            step_class = (MixedPrecisionStep,) if mixed else (ShardedStep,) if sharded else ()
            bases = (*step_class, DistributedOptimizer, base)
            sub = _SUBCLASSES[(base, sharded, mixed)] = type(base.__name__, bases, namespace)
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
        nested = dynamic_loss_args.pop("dynamic_loss_args", None)  # smp's examples pass the options as one dict
        scale_args = {**(nested or {}), **dynamic_loss_args}
        options = LossScaleOptions.from_smp(static_loss_scale, dynamic_loss_scale, scale_args)
        check_precision(state)
        self._smp_state = state
        self._smp_inner = optimizer
        self._smp_pending: Optional[dict[str, Any]] = None
        self._smp_sharded: Optional[ShardedOptimizerState] = None
        low, model = low_precision_dtype(state.config), state.model
        self._smp_mixed: Optional[MixedPrecision] = None
        if low is not None:  # check_precision made sure the model exists: the masters live where it computes
            assert model is not None
            device = model.execution_device if model.partitioned else execution_device(state, model.module)
            # Overflows are agreed over the replica (stages and TP ranks; the replicas' gradients are equal after
            # their all-reduce), over every rank with sharded state or sharded data parallelism (each rank updates
            # its own masters): smp's.
            whole = state.config.shard_optimizer_state or state.config.sharded_data_parallel_degree > 1
            group = state.world_group if whole else smp_state.get_mp_process_group()
            self._smp_mixed = MixedPrecision(self.param_groups, low, options, group, device)
            if model.partitioned:
                self._smp_mixed.masters.fill({id(p) for p in model.local_parameters()})
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

    # ---- smp's FP16-optimizer names ----------------------------------------------------------------------------

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """The model's parameters of each parameter group: under fp16/bf16 the low-precision ones (whose FP32
        masters the optimizer updates), otherwise every parameter (the optimizer updates them directly). Under
        sharded data parallelism the FP32 shards the optimizer updates, which are the masters too (FSDP computes with
        low-precision copies gathered for each forward)."""
        if self._smp_mixed is not None and self._smp_state.config.sharded_data_parallel_degree == 1:
            return [[param for param, _ in pairs] for pairs in self._smp_mixed.masters.groups]
        # (Under sharded data parallelism the FP32 shards are the model's parameters and the masters at once.)
        return [list(group["params"]) for group in self.param_groups]

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        """The FP32 masters of ``fp16_groups``, group by group (the parameters themselves without fp16/bf16)."""
        if self._smp_mixed is not None and self._smp_state.config.sharded_data_parallel_degree == 1:
            return [[master for _, master in pairs] for pairs in self._smp_mixed.masters.groups]
        return self.fp16_groups

    @property
    def overflow(self) -> bool:
        """True when the last ``step()`` was skipped because a gradient of some rank was inf or NaN (fp16 with
        ``dynamic_loss_scale=True`` only; always False otherwise)."""
        return self._smp_mixed is not None and self._smp_mixed.overflow

    @property
    def loss_scale(self) -> float:
        """The factor ``model.backward`` multiplies the loss by (fp16; 1.0 otherwise)."""
        return self._smp_mixed.loss_scale if self._smp_mixed is not None else 1.0

    def loss_scaler_state(self) -> Optional[dict[str, Any]]:
        """The loss scaler's state (the ``"loss_scaler"`` entry of the state dicts; None without fp16): what a full
        checkpoint keeps where it holds no optimizer state (tensor or sharded data parallelism)."""
        return self._smp_mixed.state_dict() if self._smp_mixed is not None else None

    def load_loss_scaler_state(self, saved: Optional[dict[str, Any]]) -> None:
        """Resume the loss scale and its counters from :meth:`loss_scaler_state` (nothing without fp16)."""
        if self._smp_mixed is not None:
            self._smp_mixed.load_state_dict(saved)

    def reload_model_params(self) -> None:
        """Take the FP32 masters from the model's current weights (after loading weights into the model only;
        ``DistributedModel.load_state_dict`` calls it). Nothing to do without fp16/bf16."""
        model = self._smp_state.model
        if self._smp_mixed is not None and (model is None or model.partitioned):
            self._smp_mixed.masters.fill(None if model is None else {id(p) for p in model.local_parameters()})

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model (every stage, each parameter once) is at
        most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` over the unpartitioned model; returns that norm.

        Under fp16/bf16 these are the FP32 master gradients, unscaled (an overflow returns -1 and clips nothing, as
        smp's); otherwise the parameters' own. Collective over the replica's stages: call it on every rank.
        """
        if norm_type != 2.0:
            raise ValueError(f"clip_master_grads supports the 2-norm only, got norm_type={norm_type}")
        if self._smp_mixed is not None and self._smp_mixed.unscale(self.param_groups, self._device_for_norm()):
            return torch.tensor(-1.0)
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
        if self._smp_mixed is not None:  # masters count as the parameters they stand for
            params = [self._smp_mixed.masters.model_param(p) for p in params]
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
        params = self._model_params()
        return {i for i, p in enumerate(params) if id(p) in held}

    def _params(self) -> list[torch.Tensor]:
        """The optimizer's parameters (masters under fp16/bf16), in ``param_groups`` order."""
        return [p for group in self.param_groups for p in group["params"]]

    def _model_params(self) -> list[torch.Tensor]:
        """The model parameters of :meth:`_params`, in the same order."""
        if self._smp_mixed is None:
            return self._params()
        return [self._smp_mixed.masters.model_param(p) for p in self._params()]

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
        self._add_fp16_state(full, held)
        full[ckpt.PARTIAL_KEY] = True
        return full

    def _add_fp16_state(self, full: dict[str, Any], held: Optional[set[int]]) -> None:
        """Under fp16/bf16: each held parameter's FP32 master in its state entry, the loss scaler beside."""
        if self._smp_mixed is not None:
            self._smp_mixed.add_masters(full["state"], self._params(), held)
            full[SCALER_KEY] = self._smp_mixed.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """State of every stage's parameters, gathered (collective over the replica's stages)."""
        if self._sharded_stage() is not None:
            raise ValueError(
                "optimizer.state_dict(): under sharded data parallelism each rank holds the state of its shards only; "
                "save optimizer.local_state_dict() per rank, or smp.save_checkpoint(..., partial=True)"
            )
        partials = ckpt.gather_partials(self.local_state_dict(), self._smp_state.mp_group, "smp_optimizer_state_dict")
        merged = ckpt.merge_optimizer_partials(partials)
        if SCALER_KEY in partials[0]:  # the same on every rank: overflows are agreed by all
            merged[SCALER_KEY] = partials[0][SCALER_KEY]
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full or partial (gathered first: collective) state dict; waits for the partition if needed."""
        if ckpt.is_partial(state_dict):
            partials = ckpt.gather_partials(state_dict, self._smp_state.mp_group, "smp_optimizer_load_state_dict")
            full = ckpt.merge_optimizer_partials(partials)
        else:
            full = {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        model = self._smp_state.model
        if model is not None and not model.partitioned:
            # The state waits for the partition (it must know which stage holds what); the hyper-parameters and
            # the loss scale do not, and an LR scheduler or a log read before the first step must see the loaded ones.
            self._load_hyperparameters(full["param_groups"])
            if self._smp_mixed is not None:
                self._smp_mixed.load_state_dict(state_dict.get(SCALER_KEY))
            self._smp_pending = full
            return
        self._load(full)
        if self._smp_mixed is not None:
            self._smp_mixed.load_state_dict(state_dict.get(SCALER_KEY))

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
        self.reload_model_params()  # the masters take the partitioned model's weights (broadcast from rank 0)
        sharded = self._sharded_stage()
        if sharded is not None:  # the script's parameters became shards: the optimizer steps those
            sharded.adopt_optimizer(self)
        if smp.config.shard_optimizer_state and self._smp_sharded is None and model is not None:
            held_params = {id(p) for p in model.local_parameters()}  # under fp16/bf16 the shards are of the masters
            held = {id(p) for p, q in zip(self._params(), self._model_params()) if id(q) in held_params}
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
        held = self._held_indices()
        state = full["state"] if held is None else {i: v for i, v in full["state"].items() if int(i) in held}
        masters: dict[int, torch.Tensor] = {}
        if self._smp_mixed is not None:
            state, masters = self._smp_mixed.take_masters(state)
        if self._smp_sharded is not None:
            self._load_hyperparameters(full["param_groups"])
            self._smp_sharded.load({"state": state, "param_groups": full["param_groups"]})
        else:
            super().load_state_dict({"state": state, "param_groups": full["param_groups"]})
        if self._smp_mixed is not None:
            self._smp_mixed.load_masters(self._params(), masters)
