"""Checks that a loaded state fits the model or optimizer, run before anything is written into either.

Each returns an :class:`~shardkit.checkpoint.errors.IncompatibleCheckpointError` naming the offending keys, so
``load_checkpoint`` can refuse the whole checkpoint while the model and optimizer are still untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from shardkit.checkpoint.errors import IncompatibleCheckpointError

_SHOW = 5


def _few(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOW])
    return shown + (f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


Shape = Optional[tuple[int, ...]]


def shapes_of(state: Mapping[str, Any]) -> dict[str, Shape]:
    """Key -> shape of every tensor entry (``None`` for non-tensor entries)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def check_model_state(expected: Mapping[str, Shape], given: Mapping[str, Shape], what: str) -> None:
    """``given`` must have exactly ``expected``'s keys with equal shapes (``None`` on either side: not compared).

    Example::

        check_model_state(shapes_of(model.state_dict()), shapes_of(loaded), "model state")
    """
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    wrong = [
        f"{key!r} has shape {given[key]} in the checkpoint, the model needs {shape}"
        for key, shape in expected.items()
        if shape is not None and given.get(key) is not None and given[key] != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_few(unexpected)}")
    problems.extend(wrong[:_SHOW])
    if problems:
        raise IncompatibleCheckpointError(
            f"{what} does not fit this model: {'; '.join(problems)}. It is a checkpoint of another model (or "
            "another version of it); build the model it was saved from. Nothing was loaded."
        )


def check_optimizer_state(state_dict: Any, groups: Sequence[Sequence[tuple[str, Shape]]], what: str) -> None:
    """A ``torch.optim`` state dict must match ``groups`` (per param group: ``(name, shape)`` of each parameter).

    Checks the number of groups and of parameters per group, and that every per-parameter state tensor that is
    not a scalar has its parameter's shape.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise IncompatibleCheckpointError(f"{what} is not a torch.optim state dict (no 'state'/'param_groups')")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise IncompatibleCheckpointError(
            f"{what} has {len(saved_groups)} param groups, this optimizer {len(groups)}; build the optimizer with "
            "the param groups it was saved with. Nothing was loaded."
        )
    for index, (saved, ours) in enumerate(zip(saved_groups, groups)):
        ids = list(saved.get("params", []))
        if len(ids) != len(ours):
            raise IncompatibleCheckpointError(
                f"{what}: param group {index} has {len(ids)} parameters in the checkpoint, {len(ours)} here; build "
                "the optimizer over the same parameters, in the same order. Nothing was loaded."
            )
        for pid, (name, shape) in zip(ids, ours):
            for key, value in dict(state_dict["state"].get(pid, {})).items():
                if shape is not None and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
                    raise IncompatibleCheckpointError(
                        f"{what}: state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, the parameter "
                        f"{shape}; the checkpoint is of another model. Nothing was loaded."
                    )


def optimizer_groups(
    optimizer: torch.optim.Optimizer, names: Optional[Mapping[int, str]] = None
) -> list[list[tuple[str, Shape]]]:
    """``(name, shape)`` of every parameter of every param group (name from ``names`` by ``id``, else its index).

    Empty tensors get shape ``None`` (not compared): pipeline stages release the parameters they do not hold.
    """
    names = names or {}
    out = []
    position = 0
    for group in optimizer.param_groups:
        entries = []
        for p in group["params"]:
            entries.append((names.get(id(p), f"#{position}"), tuple(p.shape) if p.numel() else None))
            position += 1
        out.append(entries)
    return out
