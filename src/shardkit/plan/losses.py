"""Losses ``shardkit plan`` can name on the command line (``--loss``), and user losses by import path.

The loss decides which temporaries backward starts from (a cross-entropy keeps the log-softmax of the logits, a
mean keeps nothing), so a factory's plan is only as good as its loss: name the one the run uses.

Example::

    loss = resolve_loss("cross_entropy")          # next-token cross-entropy of the logits against the tokens
    loss = resolve_loss("mypkg.losses:my_loss")   # called as my_loss(output, batch)
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from shardkit.plan.runner import LossFn, PlanError, default_loss
from shardkit.plan.workloads import next_token_cross_entropy


def output_mean(output: Any, batch: Any) -> torch.Tensor:
    """The output's mean (its ``.logits``' for transformers outputs), or the output itself if it is a scalar."""
    value = output if not hasattr(output, "logits") else output.logits
    return value if value.dim() == 0 else value.float().mean()


#: Losses by name: what each returns from ``(output, batch)``.
LOSSES: dict[str, LossFn] = {
    "mean": output_mean,
    "cross_entropy": next_token_cross_entropy,
    "output": default_loss,
}
LOSS_HELP = (
    "mean (the output's mean: backward's shape only), cross_entropy (next-token cross-entropy of the logits against "
    "the batch's tokens), output (the model returns its loss, or an output with .loss), or package.module:function "
    "called as function(output, batch)"
)


def resolve_loss(spec: str) -> LossFn:
    """The loss named ``spec`` (a key of :data:`LOSSES` or ``package.module:function``), or a clear error."""
    if spec in LOSSES:
        return LOSSES[spec]
    if ":" not in spec:
        raise PlanError(f"--loss {spec!r} is not a known loss; choose {LOSS_HELP}")
    module_name, _, attr = spec.partition(":")
    loss = import_attribute(module_name, attr, "--loss")
    try:
        inspect.signature(loss).bind(None, None)
    except TypeError:
        raise PlanError(
            f"--loss {spec}: the loss is called as {attr}(output, batch), which it does not accept"
        ) from None
    except ValueError:  # builtins without a signature: trusted
        pass
    result: LossFn = loss
    return result


def import_attribute(module_name: str, attr: str, what: str) -> Any:
    """``module_name.attr``, callable, or an error naming ``what`` and what to do."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(
            f"{what}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); install the package or run from "
            "the folder that holds it (or add it to PYTHONPATH)"
        ) from None
    value = getattr(module, attr, None)
    if value is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise PlanError(
            f"{what}: module {module_name!r} has no {attr!r}; its functions and classes: {', '.join(public[:20])}"
        )
    if not callable(value):
        raise PlanError(f"{what}: {module_name}:{attr} is a {type(value).__name__}, not a function")
    return value


__all__ = ["LOSSES", "LOSS_HELP", "import_attribute", "output_mean", "resolve_loss"]
