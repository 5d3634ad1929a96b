"""Writing a universal checkpoint from tensors in hand, without a model or a process group (world size 1).

Used by ``shardkit checkpoint import``: whatever a foreign format holds (a state dict, safetensors, another
library's DCP) becomes a complete shardkit checkpoint, published atomically with digests like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

from shardkit.checkpoint.api import save_source
from shardkit.checkpoint.errors import CheckpointError
from shardkit.checkpoint.metadata import IMPORTED_STRATEGY
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource


class _StateOnly:
    """The two things the engine reads from an optimizer: ``param_groups`` and ``state`` keyed by parameter."""

    def __init__(self, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> None:
        self.param_groups = param_groups
        self.state = state


class StaticSource(UniversalSource):
    """A source over given tensors: ``held`` as they are, with optional optimizer state per parameter name.

    ``optimizer_state`` maps a name to its state (``{"exp_avg": tensor shaped like the parameter, "step":
    0-d tensor, ...}``; non-tensor values must be JSON data); ``hyper`` maps a name to its param group's
    settings (``{"lr": 1e-3, "betas": (0.9, 0.999), ...}``). Every name with optimizer state needs settings.

    Example::

        held = [Held(t, (Span(n, t.shape, 0, t.numel()),)) for n, t in tensors.items()]
        source = StaticSource(held, {"w": {"exp_avg": m, "step": torch.tensor(3.0)}}, {"w": {"lr": 1e-3}})
    """

    strategy = IMPORTED_STRATEGY

    def __init__(
        self,
        held: list[Held],
        optimizer_state: Optional[Mapping[str, Mapping[str, Any]]] = None,
        hyper: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        self._held = list(held)
        self._optimizer: Optional[_StateOnly] = None
        if optimizer_state is None and hyper is None:
            return
        by_name = {h.spans[0].fqn: h for h in self._held if len(h.spans) == 1}
        groups: list[dict[str, Any]] = []
        state: dict[torch.Tensor, dict[str, Any]] = {}
        names = sorted(set(optimizer_state or {}) | set(hyper or {}))
        for name in names:
            holder = by_name.get(name)
            if holder is None:
                raise CheckpointError(f"optimizer state or settings for '{name}', which is not among the tensors")
            if hyper is None or name not in hyper:
                raise CheckpointError(f"optimizer state for '{name}' needs its param group settings in hyper")
            groups.append({**dict(hyper[name]), "params": [holder.tensor]})
            if optimizer_state is not None and name in optimizer_state:
                state[holder.tensor] = dict(optimizer_state[name])
        self._optimizer = _StateOnly(groups, state)

    def held(self) -> list[Held]:
        return self._held

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self._optimizer  # type: ignore[return-value]  # duck-typed: the engine reads param_groups and state


def write_state(
    directory: Union[str, Path],
    held: list[Held],
    optimizer_state: Optional[Mapping[str, Mapping[str, Any]]] = None,
    hyper: Optional[Mapping[str, Mapping[str, Any]]] = None,
    *,
    step: int = 0,
    extra: Any = None,
) -> Path:
    """Write a complete universal checkpoint of ``held`` (and optimizer state) into ``directory``.

    No process group is needed (call it in a single process, or on every rank of one). Atomic like
    ``save_checkpoint``: ``meta.json`` with every file's digest is written last. See :class:`StaticSource` for the
    optimizer arguments. Returns the directory.

    Example::

        sd = torch.load("model.pt", weights_only=True)
        write_state("ckpt", [Held(t, (Span(k, t.shape, 0, t.numel()),)) for k, t in sd.items()])
    """
    return save_source(directory, StaticSource(held, optimizer_state, hyper), step=step, extra=extra)


def whole(name: str, tensor: torch.Tensor) -> Held:
    """``tensor`` held whole under ``name`` (a convenience for :func:`write_state`)."""
    return Held(tensor, (Span(name, tensor.shape, 0, tensor.numel()),))
