"""The push-sum weight and the two forms the parameters take under Stochastic Gradient Push.

Push-sum keeps, per node, a numerator ``x`` and a weight ``w``; gossip mixes both, and the node's estimate of the
average is ``z = x / w``. Gradients are taken at ``z`` and the optimizer steps ``x``: so the parameters hold ``z``
between the forward pass and the end of the backward pass (:attr:`ParamForm.DEBIASED`) and ``x`` otherwise
(:attr:`ParamForm.NUMERATOR`). Push-pull gossip mixes doubly stochastically, keeps ``w = 1`` and never converts.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence

import torch


class ParamForm(enum.Enum):
    """What the module's parameters hold right now."""

    #: ``x``: what the optimizer steps and gossip mixes.
    NUMERATOR = "numerator"
    #: ``x / w``: what forward and backward see.
    DEBIASED = "debiased"


class PushSumState:
    """The push-sum weight of this node and the current :class:`ParamForm` of ``params``.

    The weight is a Python float holding a float32 value (it travels as one extra element of every gossip
    message). Converting between forms scales the parameters in place, so no second copy of them is kept; while
    ``w == 1`` (always, with regular graphs and uniform mixing) the conversion is skipped.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.weight = 1.0
        self.form = ParamForm.NUMERATOR

    def set_weight(self, value: float) -> None:
        """Set ``w`` (only while the parameters are numerators, so ``x / w`` stays consistent)."""
        self.require(ParamForm.NUMERATOR, "change the push-sum weight")
        self.weight = float(torch.tensor(value, dtype=torch.float32))

    def to(self, form: ParamForm) -> None:
        """Convert the parameters to ``form`` (no-op if already there): the one place forms change."""
        if form is self.form:
            return
        if self.weight != 1.0:
            with torch.no_grad():
                for p in self.params:
                    if form is ParamForm.DEBIASED:
                        p.div_(self.weight)
                    else:
                        p.mul_(self.weight)
        self.form = form

    def require(self, form: ParamForm, action: str) -> None:
        """Raise, naming ``action``, unless the parameters are in ``form`` now."""
        if self.form is not form:
            raise RuntimeError(
                f"cannot {action} while the parameters are {self.form.value}s; SlowMo converts them back to "
                "numerators at the end of backward and in perform_slowmo, so call it after backward"
            )

    def state(self) -> dict[str, object]:
        """The entries this state adds to the wrapper's ``state_dict`` (fairscale's key names)."""
        return {"ps_weight": torch.tensor([self.weight]), "is_sgp_ps_numerator": self.form is ParamForm.NUMERATOR}

    def load(self, ps_weight: object, is_numerator: object) -> None:
        """Adopt a saved weight and form; the loaded parameters are taken to be in that form."""
        if isinstance(ps_weight, torch.Tensor):
            weight = float(ps_weight.reshape(-1)[0])
        elif isinstance(ps_weight, numbers.Real):
            weight = float(ps_weight)
        else:
            raise TypeError(f"state_dict holds push-sum weight {ps_weight!r}; expected a tensor or a number")
        if not weight > 0:
            raise ValueError(f"state_dict holds push-sum weight {weight}; a weight must be > 0")
        self.weight = weight
        self.form = ParamForm.NUMERATOR if bool(is_numerator) else ParamForm.DEBIASED
