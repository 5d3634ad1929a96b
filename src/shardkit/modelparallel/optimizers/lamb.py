"""``smp.optimizers.FusedLamb``: LAMB (You et al. 2019) with Apex's ``FusedLAMB`` arguments and update rule.

LAMB is Adam with a per-layer trust ratio: each parameter tensor moves by ``lr * ||w|| / ||update||`` times
its Adam direction, so every layer changes by a similar fraction of its size. Apex's version also clips the
gradients by their *global* norm first. In a pipeline each stage holds only some parameters, so that norm is
a sum over stages: under ``smp.DistributedOptimizer`` the sum of squares is all-reduced over the replica's
stages (each parameter counted once, on the first stage holding it), which is what the smp version adds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch

from shardkit.modelparallel.optimizers import _foreach as F

_WHO = "FusedLamb"

#: ``(parameters with gradients, their squared gradient norms as one fp32 tensor) -> global sum of squares``.
SumOfSquares = Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor]


def _local_sum(params: Sequence[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
    return squares.sum()


class FusedLamb(torch.optim.Optimizer):
    """LAMB with global-norm gradient clipping (Apex's ``FusedLAMB``, without Apex).

    At step ``t``, with ``G`` the L2 norm of all gradients together and ``c = G / max_grad_norm`` when
    ``G > max_grad_norm`` (else 1), for each parameter tensor ``w`` with gradient ``g``::

        s = g / c                       (+ wd * w when adam_w_mode=False: L2 regularisation)
        m = b1 m + b3 s;  v = b2 v + (1 - b2) s^2          # b3 = 1 - b1 with grad_averaging, else 1
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  (+ wd * w when adam_w_mode=True)
        r = ||w|| / ||u|| when both are non-zero, else 1   # only when wd != 0 or use_nvlamb
        w -= lr * r * u

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - b^t``.
        betas: ``(b1, b2)`` of the two moments.
        eps: added to the denominator.
        weight_decay: ``wd`` above (Apex's default 0.01).
        amsgrad: not supported (as in Apex): True raises.
        adam_w_mode: decoupled weight decay (True) or L2 regularisation of the gradient (False).
        grad_averaging: multiply the new gradient by ``1 - b1`` in the first moment.
        set_grad_none: ``zero_grad()`` drops gradients instead of zeroing them.
        max_grad_norm: clip the global gradient norm to this (taken from the constructor's value for every
            group, as in Apex); 0 turns clipping off (Apex would divide by zero).
        use_nvlamb: apply the trust ratio to parameters without weight decay too.

    State per parameter: ``exp_avg``, ``exp_avg_sq`` (in the parameter's dtype) and ``step`` (Apex counts
    steps per group; per parameter, one that skips a step keeps its own count). Unlike Apex the gradients are
    left untouched. fp16/bf16 parameters are updated in fp32 maths.

    Example::

        optimizer = smp.DistributedOptimizer(smp.optimizers.FusedLamb(model.parameters(), lr=2e-3))
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError(f"{_WHO} does not support the AMSGrad variant (amsgrad=True); leave it False")
        F.check_non_negative(_WHO, lr=lr, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": F.check_betas(_WHO, betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        self.use_nvlamb = bool(use_nvlamb)
        self._sum_of_squares: SumOfSquares = _local_sum
        self.last_grad_norm: Optional[torch.Tensor] = None
        """The global gradient norm the last ``step()`` saw, before clipping (over every stage under smp)."""

    def set_sum_of_squares(self, reducer: Optional[SumOfSquares]) -> None:
        """How the global gradient norm's sum of squares is formed from this process's share (None: locally).

        ``smp.DistributedOptimizer`` installs one that sums over the pipeline stages; the reducer is a
        collective, so every process of the group must call ``step()``.
        """
        self._sum_of_squares = reducer if reducer is not None else _local_sum

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop (``set_grad_none``, or ``set_to_none`` when given) or zero every gradient."""
        F.zero_grad(self, self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One LAMB update of every parameter that has a gradient (collective under smp, see above)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, *found) for group in self.param_groups for found in F.batches(self, group, _WHO)]
        clip = self._clip_divisor([batch for _, _, _, batch in work])
        for group, device, dtype, batch in work:
            self._update(group, device, dtype, batch, clip.to(device))
        return loss

    def _clip_divisor(self, batches: list[F.Batch]) -> torch.Tensor:
        """``c`` of the class docstring: what every gradient is divided by (1 when no clipping is needed)."""
        params = [p for batch in batches for p in batch.params]
        squares = [torch.stack(F.foreach_norm(F.as_fp32(batch.grads))).float() ** 2 for batch in batches]
        device = params[0].device if params else self._any_device()
        local = torch.cat([s.to(device) for s in squares]) if squares else torch.zeros(0, device=device)
        global_norm = torch.sqrt(self._sum_of_squares(params, local))
        self.last_grad_norm = global_norm.detach()
        max_norm = float(self.defaults["max_grad_norm"])
        if max_norm <= 0:
            return torch.ones((), device=device)
        return torch.where(global_norm > max_norm, global_norm / max_norm, torch.ones_like(global_norm))

    def _any_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return torch.device(p.device)
        return torch.device("cpu")

    def _update(
        self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, batch: F.Batch, clip: torch.Tensor
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        for p, state in zip(batch.params, batch.states):
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        steps = F.advance_steps(batch.states, device)
        if group["bias_correction"]:
            correction1, correction2 = 1.0 - torch.pow(beta1, steps), 1.0 - torch.pow(beta2, steps)
        else:
            correction1 = correction2 = torch.ones_like(steps)
        exp_avgs = [state["exp_avg"] for state in batch.states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in batch.states]
        with F.fp32_math(dtype, batch.params, exp_avgs, exp_avg_sqs) as (params, m, v):
            scaled = F.foreach_div(F.as_fp32(batch.grads), clip)
            if decay != 0 and not self.adam_w_mode:
                F.foreach_add_(scaled, params, alpha=decay)
            F.foreach_mul_(m, beta1)
            F.foreach_add_(m, scaled, alpha=beta3)
            F.foreach_mul_(v, beta2)
            F.foreach_addcmul_(v, scaled, scaled, value=1.0 - beta2)
            denom = F.foreach_div(v, list(correction2.unbind(0)))
            F.foreach_sqrt_(denom)
            F.foreach_add_(denom, eps)
            update = F.foreach_div(m, denom)
            F.foreach_div_(update, list(correction1.unbind(0)))
            if decay != 0 and self.adam_w_mode:
                F.foreach_add_(update, params, alpha=decay)
            ratio = torch.full_like(steps, lr)
            if self.use_nvlamb or decay != 0:
                w_norm = torch.stack(F.foreach_norm(params)).float()
                u_norm = torch.stack(F.foreach_norm(update)).float()
                trusted = (w_norm > 0) & (u_norm > 0)
                ratio = torch.where(trusted, lr * w_norm / torch.where(trusted, u_norm, 1.0), ratio)
            F.foreach_mul_(update, list((-ratio).unbind(0)))
            F.foreach_add_(params, update)
