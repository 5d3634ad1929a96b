"""``smp.optimizers.FusedNovoGrad``: NovoGrad (Ginsburg et al. 2019) with Apex's arguments and update rule.

NovoGrad keeps Adam's first moment per element but its second moment per *layer*: a running average of the
gradient's norm, one number per parameter tensor. Apex's variant, reproduced here, keeps the norm itself
(not its square) so that the L2 and the infinity norm blend alike, and divides it by ``sqrt(1 - beta2^t)``
for bias correction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from shardkit.modelparallel.optimizers import _foreach as F

_WHO = "FusedNovoGrad"


class FusedNovoGrad(torch.optim.Optimizer):
    """NovoGrad, per-layer normalised gradients with momentum (Apex's ``FusedNovoGrad``, without Apex).

    For each parameter tensor ``w`` with gradient ``g`` at step ``t``::

        n_t = b2 * n_{t-1} (+) (1 - b2) * ||g||        # L2: n_t = sqrt(b2 n^2 + (1-b2) ||g||^2); inf: linear
        d_t = n_t / sqrt(1 - b2^t) + eps                # the bias correction only with bias_correction=True
        reg_inside_moment=False:  m_t = b1 m + b3 g;             w -= lr * (m_t / (1 - b1^t) / d_t + wd * w)
        reg_inside_moment=True:   m_t = b1 m + b3 (g / d_t + wd * w);  w -= lr * m_t / (1 - b1^t)

    with ``b3 = 1 - b1`` when ``grad_averaging`` else 1, and ``n_0`` the first gradient's norm (``init_zero``:
    0). ``reg_inside_moment=True, grad_averaging=False, bias_correction=False`` is the paper's algorithm.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - b1^t`` and ``sqrt(1 - b2^t)``.
        betas: ``(b1, b2)``, the decay of the gradient's and of the norm's running averages.
        eps: added to the normalising norm.
        weight_decay: ``wd`` above.
        amsgrad: not supported (as in Apex): True raises.
        reg_inside_moment: weight decay and normalisation inside the moment (the paper) or in the update only.
        grad_averaging: multiply the new gradient by ``1 - b1`` in the moment.
        norm_type: 2 for the L2 norm, 0 for the infinity norm of each layer's gradient.
        init_zero: start the norm average at 0 instead of the first gradient's norm.
        set_grad_none: ``zero_grad()`` drops gradients instead of zeroing them.

    State per parameter: ``exp_avg`` (the moment, in the parameter's dtype), ``exp_avg_sq`` (the averaged
    norm, an fp32 scalar) and ``step``. Apex keeps the step and norms per group; per parameter, a parameter
    that skips a step (no gradient) keeps its own count. fp16/bf16 parameters are updated in fp32 maths.

    Example::

        optimizer = smp.optimizers.FusedNovoGrad(model.parameters(), lr=1e-2, weight_decay=1e-3)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError(f"{_WHO} does not support the AMSGrad variant (amsgrad=True); leave it False")
        if norm_type not in (0, 2):
            raise ValueError(f"{_WHO} norm_type must be 2 (L2 norm) or 0 (infinity norm), got {norm_type!r}")
        F.check_non_negative(_WHO, lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": F.check_betas(_WHO, betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "norm_type": norm_type,
            "init_zero": init_zero,
        }
        super().__init__(params, defaults)
        self.reg_inside_moment = bool(reg_inside_moment)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop (``set_grad_none``, or ``set_to_none`` when given) or zero every gradient."""
        F.zero_grad(self, self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One NovoGrad update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for device, dtype, batch in F.batches(self, group, _WHO):
                self._update(group, device, dtype, batch)
        return loss

    def _update(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, batch: F.Batch) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        grads = F.as_fp32(batch.grads)
        norms = torch.stack(F.foreach_norm(grads, 2.0 if group["norm_type"] == 2 else float("inf"))).float()
        for i, (p, state) in enumerate(zip(batch.params, batch.states)):
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # Starting from the first norm makes the first blend a no-op (Apex's default).
                state["exp_avg_sq"] = torch.zeros((), device=device) if group["init_zero"] else norms[i].clone()
        steps = F.advance_steps(batch.states, device)
        averaged = torch.stack([state["exp_avg_sq"].float() for state in batch.states])
        if group["norm_type"] == 2:
            averaged = torch.sqrt(beta2 * averaged * averaged + (1.0 - beta2) * norms * norms)
        else:
            averaged = beta2 * averaged + (1.0 - beta2) * norms
        F.foreach_copy_([state["exp_avg_sq"] for state in batch.states], list(averaged.unbind(0)))
        if group["bias_correction"]:
            correction1 = 1.0 - torch.pow(beta1, steps)
            correction2 = torch.sqrt(1.0 - torch.pow(beta2, steps))
        else:
            correction1 = correction2 = torch.ones_like(steps)
        denom = averaged / correction2 + eps
        moments = [state["exp_avg"] for state in batch.states]
        with F.fp32_math(dtype, batch.params, moments) as (params, exp_avgs):
            if self.reg_inside_moment:  # the paper: normalise and decay inside the moment
                scaled = F.foreach_div(grads, list(denom.unbind(0)))
                if decay != 0:
                    F.foreach_add_(scaled, params, alpha=decay)
                F.foreach_mul_(exp_avgs, beta1)
                F.foreach_add_(exp_avgs, scaled, alpha=beta3)
                step_size = -lr / correction1
            else:  # decoupled: the moment averages raw gradients; decay joins the update
                F.foreach_mul_(exp_avgs, beta1)
                F.foreach_add_(exp_avgs, grads, alpha=beta3)
                if decay != 0:
                    F.foreach_mul_(params, 1.0 - lr * decay)
                step_size = -lr / (correction1 * denom)
            F.foreach_add_(params, F.foreach_mul(exp_avgs, list(step_size.unbind(0))))
