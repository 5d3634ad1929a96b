"""AMP loss scaling: ``ShardedGradScaler`` for sharded gradients, and fairscale's fp16-tolerant ``GradScaler``."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.amp import GradScaler as TorchGradScaler

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike
from shardkit.utils._torch_private import scaler_optimizer_state, scaler_scale, set_scaler_device


def _check_init_scale(init_scale: Any, who: str) -> None:
    if isinstance(init_scale, (str, torch.device)):
        raise TypeError(
            f"{who}'s first argument is init_scale, as in fairscale (got {init_scale!r}); pass the device by name: "
            f"{who}(device={str(init_scale)!r})"
        )


class _DeviceInferringScaler(TorchGradScaler):
    """A ``torch.amp.GradScaler`` whose device type defaults to that of the first tensor it scales."""

    def __init__(
        self,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        enabled: bool,
        device: Optional[Union[str, torch.device]],
    ) -> None:
        _check_init_scale(init_scale, type(self).__name__)
        self._infer_device = device is None
        device_type = "cpu" if device is None else torch.device(device).type
        super().__init__(device_type, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` by the scale (see ``torch.amp.GradScaler.scale``); fixes the device if inferred."""
        if self._infer_device and self.is_enabled() and scaler_scale(self) is None:
            first = _first_tensor(outputs)
            if first is not None:
                set_scaler_device(self, first.device.type)
        return super().scale(outputs)


class GradScaler(_DeviceInferringScaler):
    """fairscale's ``GradScaler``: a ``torch.amp.GradScaler`` that also unscales fp16 gradients.

    torch's scaler refuses fp16 gradients ("Attempting to unscale FP16 gradients"); models kept in fp16 (for
    example with an fp16-aware optimizer) need them unscaled all the same. Use :class:`ShardedGradScaler` with
    sharded gradients instead.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for ``torch.amp.GradScaler``.
        device: keyword only; device type of the scale. Default: taken from the first tensor given to
            :meth:`scale`, ``"cpu"`` until then.

    Example::

        scaler = GradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, device)

    @torch.no_grad()
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        # torch's version refuses fp16 gradients unless told otherwise, and its switch is reachable only through
        # the base class's private method; unscaling is done here instead, with public operations: each
        # gradient is checked for inf/NaN (before scaling, as torch does) and multiplied by the inverse scale.
        # The result is what torch's returns: one "found inf" flag per device that holds gradients.
        found_per_device: dict[torch.device, torch.Tensor] = {}
        inv_per_device: dict[torch.device, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    grad = param.grad = grad.coalesce()
                device = grad.device
                if device not in found_per_device:
                    found_per_device[device] = found_inf.to(device, copy=True)
                    inv_per_device[device] = inv_scale.to(device)
                values = grad.values() if grad.is_sparse else grad
                nonfinite = torch.logical_not(torch.isfinite(values).all()).to(torch.float32)
                torch.maximum(found_per_device[device], nonfinite, out=found_per_device[device])
                grad.mul_(inv_per_device[device])
        return found_per_device


class ShardedGradScaler(_DeviceInferringScaler):
    """A ``torch.amp.GradScaler`` whose skip decision is shared by every rank of a process group.

    With sharded gradients (:class:`shardkit.nn.ShardedDataParallel` + :class:`shardkit.optim.OSS`) an inf or
    NaN may appear in one rank's shard only. After unscaling, each rank's "found inf" flag is all-reduced with
    MAX, so either every rank steps or every rank skips (and lowers the scale) together; otherwise the ranks'
    parameters and scales would drift apart.

    The positional arguments are fairscale's (``ShardedGradScaler(1024.0)`` sets ``init_scale``). Unlike
    fairscale's, which turns itself off without CUDA, it also scales on CPU.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for ``torch.amp.GradScaler``.
        process_group: group whose ranks must agree. Default: the optimizer's own ``group`` when it has one
            (OSS), else the world group; with ``torch.distributed`` not initialised, no synchronisation.
        device: keyword only; device type of the scale (``"cuda"``, ``"cpu"``, ...). Default: taken from the
            first tensor given to :meth:`scale` (the loss), ``"cpu"`` until then.

    Example::

        scaler = ShardedGradScaler()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)      # skipped on every rank if any rank saw inf/NaN
        scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[GroupLike] = None,
        *,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, device)
        self.process_group = process_group

    def _group_for(self, optimizer: torch.optim.Optimizer) -> Optional[GroupLike]:
        if self.process_group is not None:
            return self.process_group
        own = getattr(optimizer, "group", None)
        if own is not None:
            return own
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients of ``optimizer``, then agree with every rank on whether any had inf/NaN."""
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        state = scaler_optimizer_state(self, optimizer)
        found_per_device: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        scale = scaler_scale(self)
        assert scale is not None
        # One flag per rank, on the scale's device: ranks may hold gradients on different devices, or none at all
        # (every gradient it would check was freed by ShardedDataParallel), yet all must issue the same collective.
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        for flag in found_per_device.values():
            found = torch.maximum(found, flag.to(scale.device))
        group = self._group_for(optimizer)
        if group is not None:
            collectives.all_reduce(found, op=dist.ReduceOp.MAX, group=group, label="grad_scaler.found_inf")
        for device, flag in found_per_device.items():
            flag.copy_(found.to(device))
        if not found_per_device:
            state["found_inf_per_device"] = {scale.device: found}


def _first_tensor(outputs: Any) -> Optional[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (list, tuple)):
        for item in outputs:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None
