"""What a stage holds, seen from outside: local parameters/buffers/modules, state dicts, ``cpu()``.

A mixin of :class:`~shardkit.modelparallel.model.DistributedModel`, kept apart so the wrapper's file holds the
life cycle (partition, forward, backward) and this one the views on its result.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from shardkit.modelparallel import checkpoint as ckpt
from shardkit.modelparallel.execution import StageExecution
from shardkit.modelparallel.plan import PipelinePlan
from shardkit.modelparallel.state import SMPState


class LocalViewsMixin:
    """Local views and state dicts of a partitioned model (see the module docstring)."""

    module: nn.Module
    _smp: SMPState
    _plan: Optional[PipelinePlan]
    _execution: Optional[StageExecution]
    _held: set[str]
    _key_map: dict[str, str]
    _device: torch.device

    @property
    def partitioned(self) -> bool:
        """True once the first step has partitioned the model."""
        return self._execution is not None

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters this stage holds (all of them before the partition)."""
        for name, param in self.module.named_parameters():
            if not self.partitioned or name in self._held:
                yield name, param

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this stage holds."""
        for _, param in self.local_named_parameters():
            yield param

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, buffer) for the buffers this stage holds."""
        for name, buf in self.module.named_buffers():
            if not self.partitioned or name in self._held:
                yield name, buf

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """The buffers this stage holds."""
        for _, buf in self.local_named_buffers():
            yield buf

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) for the modules that run on this stage (all before the partition)."""
        if not self.partitioned:
            yield from self.module.named_modules()
            return
        assert self._plan is not None
        for unit, stage in self._plan.units.items():
            if stage == self._smp.topology.mp_rank:
                for sub, module in self.module.get_submodule(unit).named_modules():
                    yield (f"{unit}.{sub}" if unit and sub else unit or sub), module

    @property
    def execution_device(self) -> torch.device:
        """The device this stage computes on (where its held parameters live after the partition)."""
        return self._device

    def first_holder_mask(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """For each parameter, whether this stage is the lowest one holding it.

        Summing a per-parameter quantity (a squared gradient norm) over the stages only where this is True
        counts every parameter once, tied and replicated copies included. A tensor that is not one of the
        model's parameters counts here. Before the partition every parameter counts.
        """
        if not self.partitioned or self._plan is None:
            return [True] * len(params)
        names = {id(p): name for name, p in self.module.named_parameters()}
        stage = self._smp.topology.mp_rank
        holders = self._plan.holders
        return [min(holders.get(names.get(id(p), ""), (stage,))) == stage for p in params]

    def local_modules(self) -> Iterator[nn.Module]:
        """The modules that run on this stage."""
        for _, module in self.local_named_modules():
            yield module

    # ---- state dicts (see checkpoint.py) -------------------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's parameters and buffers by their module names, marked ``_smp_is_partial``."""
        full = self.module.state_dict()
        if self.partitioned:
            full = OrderedDict((k, v) for k, v in full.items() if self._key_map.get(k, k) in self._held)
        out: dict[str, Any] = dict(full)
        out[ckpt.PARTIAL_KEY] = True
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The whole model's state dict (keys of the unwrapped module), gathered from every stage.

        Collective over the replica's stages: call it on every rank of the mp group.
        """
        if not self.partitioned:
            return self.module.state_dict(*args, **kwargs)
        partials = ckpt.gather_partials(self.local_state_dict(), self._smp.mp_group, "smp_model_state_dict")
        return ckpt.merge_model_partials(partials, list(self._key_map))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a full or partial state dict (partial ones are first gathered from every stage: collective).

        Before the partition the model loads it whole; after it, each stage copies what it holds.
        """
        if ckpt.is_partial(state_dict):
            partials = ckpt.gather_partials(state_dict, self._smp.mp_group, "smp_model_load_state_dict")
            keys = [k for p in partials for k in p if k != ckpt.PARTIAL_KEY]
            full: dict[str, Any] = dict(ckpt.merge_model_partials(partials, list(dict.fromkeys(keys))))
        else:
            full = dict(state_dict)
        if not self.partitioned:
            return self.module.load_state_dict(full, strict=strict)
        self._load_held(full, strict)
        return None

    def _load_held(self, full: Mapping[str, Any], strict: bool) -> None:
        current = self.module.state_dict(keep_vars=True)
        missing = []
        with torch.no_grad():
            for key, tensor in current.items():
                if self._key_map.get(key, key) not in self._held:
                    continue
                if key not in full:
                    missing.append(key)
                    continue
                tensor.copy_(full[key])
        if strict and missing:
            raise KeyError(f"load_state_dict: the state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def cpu(self) -> Any:
        """Gather every stage's parameters and buffers so this rank holds the whole model, on the CPU."""
        if self.partitioned:
            full = self.state_dict()
            with torch.no_grad():
                for key, tensor in self.module.state_dict(keep_vars=True).items():
                    tensor.data = full[key].detach().clone().cpu()
            self._held = set(self._key_map.values())
            self._device = torch.device("cpu")
            if self._execution is not None:
                self._execution.runtime.device = self._device
        self.module.cpu()
        return self
