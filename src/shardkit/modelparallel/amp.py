"""``smp.amp.GradScaler``: torch's loss scaler, with the overflow check agreed by every rank.

Each stage only sees its own gradients, so one stage can overflow while the others do not. After unscaling,
the found-inf flags are all-reduced (max) over the world, so every stage and replica skips or takes the step
together and keeps the same scale.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed import DummyProcessGroup
from shardkit.distributed import collectives as C
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.optimizer import DistributedOptimizer
from shardkit.utils._torch_private import scaler_optimizer_state, scaler_scale


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check spans every stage and replica.

    Example::

        scaler = smp.amp.GradScaler()

        @smp.step
        def train_step(model, x, y):
            with torch.autocast("cuda"):
                loss = loss_fn(model(x), y)
            model.backward(scaler.scale(loss))
            return loss

        train_step(model, x, y)
        scaler.step(optimizer)
        scaler.update()
    """

    def __init__(
        self,
        device: Optional[str] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if enabled:
            _refuse_with_fp16_optimizer(None)
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree on overflow with every other rank."""
        if self.is_enabled():
            _refuse_with_fp16_optimizer(optimizer)
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        per_device = scaler_optimizer_state(self, optimizer)["found_inf_per_device"]
        if not per_device:  # a stage without gradients still votes, and step() needs one entry
            scale = scaler_scale(self)
            assert scale is not None
            per_device[scale.device] = torch.zeros((), dtype=torch.float32, device=scale.device)
        flags = list(per_device.values())
        found = torch.stack([f.to(flags[0].device) for f in flags]).amax()
        group = smp_state.current().world_group if smp_state.is_initialized() else None
        if group is not None and not isinstance(group, DummyProcessGroup) and dist.get_world_size(group) > 1:
            C.all_reduce(found, op=dist.ReduceOp.MAX, group=group, label="smp_amp_found_inf")
        for flag in flags:
            flag.copy_(found.to(flag.device))


def _refuse_with_fp16_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Under ``"fp16"``/``"bf16"`` smp's own FP16 optimizer scales the loss and owns FP32 master weights: a second
    scaler over its masters would unscale gradients they do not hold yet. Checked when the scaler is made (None)
    and when it unscales an smp optimizer."""
    if (optimizer is None or isinstance(optimizer, DistributedOptimizer)) and smp_state.is_initialized():
        config = smp_state.current().config
        if config.fp16 or config.bf16:
            key = "fp16" if config.fp16 else "bf16"
            raise ValueError(
                f"smp.amp.GradScaler with '{key}': true: smp.DistributedOptimizer already keeps FP32 masters and "
                "(fp16) scales the loss itself; drop the GradScaler (call model.backward(loss) and optimizer.step()), "
                f"or set '{key}': false and train under torch.autocast with the GradScaler"
            )
