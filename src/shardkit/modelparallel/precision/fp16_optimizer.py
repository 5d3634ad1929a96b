"""smp's FP16/BF16 training (``"fp16": true`` or ``"bf16": true``): a half-precision model, FP32 master weights.

What smp v1.10+ does under these keys, and what this module provides for ``DistributedModel`` and
``DistributedOptimizer``:

- the model is cast to the low dtype when ``smp.DistributedModel`` wraps it (a no-op for one created in it under
  ``smp.model_creation(dtype=...)``); its floating-point inputs are cast to that dtype and its floating-point
  outputs back to FP32 (smp's ``FP16_Module``): :func:`cast_model`, :func:`cast_inputs`, :func:`cast_outputs`;
- the optimizer updates an FP32 master copy of every low-precision parameter (:class:`MasterWeights`): its
  ``param_groups`` hold the masters, ``fp16_groups`` the model's parameters; after each update the masters are
  rounded into the model;
- under fp16, ``model.backward(loss)`` multiplies the loss (in FP32) by the loss scale; before the update the
  gradients are copied into the masters and divided by it; a dynamic scale checks them for inf/NaN, agreed by
  the replica's ranks (all pipeline stages and tensor-parallel ranks; replicas hold the same gradients after their
  all-reduce, so they agree too; every rank with ``shard_optimizer_state``, as smp), and an overflow skips the step
  on all of them (:class:`MixedPrecision`, the scale rules in :mod:`~.loss_scaler`). bf16 has FP16's exponent
  range problem solved by its 8-bit exponent: no scale, no check.

Under sharded data parallelism (``sharded_data_parallel_degree`` > 1) the model stays FP32: its FP32 shards are the
masters the optimizer updates (there is no low-precision copy to keep, FSDP casts the gathered parameters for each
forward), so :class:`MasterWeights` holds no pair; the loss is scaled and the shards' gradients unscaled and checked
as above, the overflow agreed over the whole world (every rank's shards differ). ``fp16_groups`` and
``fp32_from_fp16_groups`` are then both the optimizer's FP32 shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import GroupLike
from shardkit.distributed import collectives as C
from shardkit.modelparallel._torch_private import foreach_mul_, foreach_norm
from shardkit.modelparallel.precision.loss_scaler import LossScaleOptions, LossScaler
from shardkit.nn.fsdp.input_cast import unit_input_caster
from shardkit.utils._torch_private import tree_map

#: The key of a parameter's FP32 master weight inside its entry of the optimizer's state dict.
MASTER_KEY = "fp32_master_param"
#: The top-level key of the loss scaler's state in the optimizer's state dict.
SCALER_KEY = "loss_scaler"


def low_precision_dtype(config: Any) -> Optional[torch.dtype]:
    """The dtype the smp config trains the model in: float16, bfloat16, or None (the model's own)."""
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None


def cast_model(module: nn.Module, config: Any) -> None:
    """Cast ``module``'s floating-point parameters and buffers to the config's low dtype, in place (the
    parameters stay the same objects, so an optimizer built over them before still holds them).

    Under sharded data parallelism the other way round: the low-dtype ones (a model created under
    ``smp.model_creation(dtype=...)``) become FP32, since its shards are the FP32 masters and FSDP computes with
    low-precision copies of them (:mod:`~shardkit.modelparallel.sdp.wrap`)."""
    low = low_precision_dtype(config)
    if low is None:
        return
    if not _shards_are_masters(config):
        module.to(low)
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.dtype == low:
                tensor.data = tensor.data.float()


def cast_inputs(args_kwargs: Any, config: Any) -> Any:
    """The model's inputs with their floating-point tensors in the config's low dtype (unchanged without one, and
    under sharded data parallelism, where the sharded root casts them)."""
    low = low_precision_dtype(config)
    if low is None or _shards_are_masters(config):
        return args_kwargs
    return unit_input_caster(low, False, None)(args_kwargs)


def _shards_are_masters(config: Any) -> bool:
    """Whether the model's FP32 shards are the masters (sharded data parallelism): no low-precision model copy."""
    return bool(config.sharded_data_parallel_degree > 1)


def cast_outputs(outputs: Any, config: Any) -> Any:
    """The model's outputs with their low-precision tensors in FP32 (differentiable), as smp's FP16_Module."""
    low = low_precision_dtype(config)
    if low is None:
        return outputs
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == low else t, outputs)


class MasterWeights:
    """FP32 masters of the low-precision parameters in ``param_groups``, which hold the masters from then on.

    Made when the optimizer is wrapped, possibly before the partition: each master starts empty on ``device`` (where
    the stage computes: its parameters are there after the partition) and takes its parameter's value in
    :meth:`fill` (after the partition, for the parameters this stage holds).
    """

    def __init__(self, param_groups: list[dict[str, Any]], low: torch.dtype, device: torch.device) -> None:
        self._model_of: dict[int, torch.Tensor] = {}
        self.groups: list[list[tuple[torch.Tensor, nn.Parameter]]] = []
        """Per parameter group, (model parameter, its master) pairs."""
        for group in param_groups:
            pairs = []
            for i, param in enumerate(group["params"]):
                if param.dtype == low:
                    master = nn.Parameter(torch.empty(0, dtype=torch.float32, device=device))
                    group["params"][i] = master
                    self._model_of[id(master)] = param
                    pairs.append((param, master))
            self.groups.append(pairs)
        self.filled = False
        """Whether the masters hold their parameters' values (else they are empty placeholders)."""

    def pairs(self) -> Iterator[tuple[torch.Tensor, nn.Parameter]]:
        """Every (model parameter, master) pair."""
        return (pair for pairs in self.groups for pair in pairs)

    def model_param(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model parameter a master stands for (any other tensor is its own)."""
        return self._model_of.get(id(tensor), tensor)

    def fill(self, held: Optional[set[int]]) -> None:
        """Each master takes its model parameter's value, for the parameters in ``held`` (ids; None: all); the
        others' masters are released (their stage updates them)."""
        with torch.no_grad():
            for param, master in self.pairs():
                if held is None or id(param) in held:
                    master.data = param.detach().to(device=master.device, dtype=torch.float32, copy=True)
                else:
                    master.data = torch.empty(0, dtype=torch.float32, device=master.device)
                master.grad = None
        self.filled = True

    def to_model(self) -> None:
        """Round the masters into the model parameters (after an update)."""
        with torch.no_grad():
            for param, master in self.pairs():
                if master.numel() and param.numel():
                    param.copy_(master)

    def grads_to_masters(self) -> None:
        """Each master's gradient becomes its parameter's, in FP32 (None where the parameter has none)."""
        for param, master in self.pairs():
            grad = param.grad
            if grad is None or not master.numel():
                master.grad = None
            elif master.grad is not None and master.grad.shape == grad.shape:
                master.grad.copy_(grad)
            else:
                master.grad = grad.detach().to(device=master.device, dtype=torch.float32, copy=True)

    def zero_model_grads(self, set_to_none: bool) -> None:
        """Clear the model parameters' gradients (the masters' are the optimizer's to clear)."""
        for param, _ in self.pairs():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()


class MixedPrecision:
    """The state of smp's FP16 optimizer beside the user's: masters, loss scaler, overflow of the last step.

    ``step`` and ``clip`` first :meth:`unscale` (once per step): gradients into the masters, divided by the scale,
    checked for overflow over ``group`` (collective: every rank calls ``step``, as smp requires).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        low: torch.dtype,
        options: LossScaleOptions,
        group: GroupLike,
        device: torch.device,
    ) -> None:
        self.low = low
        self.masters = MasterWeights(param_groups, low, device)
        self.scaler: Optional[LossScaler] = LossScaler(options) if low == torch.float16 else None
        self.group = group
        self.overflow = False
        """True when the last ``step()`` was skipped for an inf/NaN gradient (dynamic scale only)."""
        self._unscaled = False

    @property
    def loss_scale(self) -> float:
        """What ``model.backward`` multiplies the loss by (1.0 under bf16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def unscale(self, param_groups: list[dict[str, Any]], device: torch.device) -> bool:
        """Once per step: the masters' gradients from the model's, every gradient divided by the loss scale, and
        (dynamic scale) whether any rank found an inf/NaN; returns that."""
        if self._unscaled:
            return self.overflow
        self.masters.grads_to_masters()
        grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
        if self.loss_scale != 1.0 and grads:
            foreach_mul_(grads, 1.0 / self.loss_scale)
        self.overflow = False
        if self.scaler is not None and self.scaler.dynamic:
            self.overflow = self._any_rank_overflows(grads, device)
        self._unscaled = True
        return self.overflow

    def _any_rank_overflows(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """Whether a gradient of any rank holds an inf or NaN (all-reduce of one flag over ``group``).

        Read from each gradient's 2-norm, which an inf or NaN makes non-finite: one fused pass over the gradients
        (an elementwise ``isfinite`` costs several times more on CPU). A finite gradient whose norm exceeds FP32's
        range (above ~1e19 per element after unscaling) also counts, as it would wreck the update anyway.
        """
        norms = foreach_norm(grads) if grads else []
        finite = torch.stack([n.to(device) for n in norms]).isfinite().all() if norms else None
        found = (~finite).to(torch.float32) if finite is not None else torch.zeros((), device=device)
        C.all_reduce(found.reshape(1), op=dist.ReduceOp.MAX, group=self.group, label="smp_fp16_overflow")
        return bool(found.item())

    def step(self, param_groups: list[dict[str, Any]], device: torch.device, update: Callable[[], Any]) -> Any:
        """Unscale, adapt the scale, then ``update()`` the masters and round them into the model, unless an
        overflow skips the step."""
        overflow = self.unscale(param_groups, device)
        self._unscaled = False
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            return None
        result = update()
        self.masters.to_model()
        return result

    def zero_grad(self, set_to_none: bool) -> None:
        """Clear the model's gradients; a new step starts (the next ``unscale`` reads them afresh)."""
        self.masters.zero_model_grads(set_to_none)
        self._unscaled = False

    def add_masters(self, state: dict[int, Any], params: list[torch.Tensor], indices: Optional[set[int]]) -> None:
        """Put each filled master of ``params`` (the optimizer's, in order) whose index is in ``indices`` (None:
        all) into its entry of ``state`` (a torch-format state dict's, entries copied, not changed)."""
        if not self.masters.filled:
            return
        for index, param in enumerate(params):
            if self.masters.model_param(param) is not param and param.numel() and (indices is None or index in indices):
                state[index] = {**state.get(index, {}), MASTER_KEY: param.detach()}

    def take_masters(self, state: Mapping[Any, Any]) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
        """``state`` without the masters (entries left empty dropped), and the masters by parameter index."""
        rest: dict[int, Any] = {}
        masters: dict[int, torch.Tensor] = {}
        for index, entry in state.items():
            entry = dict(entry)
            if MASTER_KEY in entry:
                masters[int(index)] = entry.pop(MASTER_KEY)
            if entry:
                rest[int(index)] = entry
        return rest, masters

    def load_masters(self, params: list[torch.Tensor], masters: Mapping[int, torch.Tensor]) -> None:
        """Copy saved masters into this stage's (by the optimizer's parameter index; shapes must agree)."""
        with torch.no_grad():
            for index, saved in masters.items():
                param = params[index]
                if self.masters.model_param(param) is param or not param.numel():
                    continue  # an FP32 parameter, or one another stage holds
                if tuple(saved.shape) != tuple(param.shape):
                    raise ValueError(
                        f"the loaded optimizer state's FP32 master of parameter {index} has shape "
                        f"{tuple(saved.shape)}, this model's {tuple(param.shape)}: load a checkpoint of the same model "
                        "and layout"
                    )
                param.copy_(saved)

    def state_dict(self) -> Optional[dict[str, Any]]:
        """The loss scaler's state (None under bf16)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Resume the loss scaler (a state dict saved without one keeps the current scale)."""
        if self.scaler is not None and saved is not None:
            self.scaler.load_state_dict(saved)


def check_precision(state: Any) -> None:
    """Refuse what the FP16 optimizer cannot do right (before anything is changed; the same on every rank)."""
    config = state.config
    low = "fp16" if config.fp16 else "bf16" if config.bf16 else None
    if low is None:
        return  # smp applies the loss-scaling options only under fp16/bf16: no effect, as there
    if state.model is None:
        raise ValueError(
            f"under '{low}': true, create smp.DistributedModel before smp.DistributedOptimizer: the model is cast to "
            f"{low} when it is wrapped, and the optimizer keeps FP32 masters of its {low} parameters (smp's order)"
        )
