"""What one stage holds of the wrapped model: local parameters, buffers and modules, and its state dicts.

:class:`StageHolding` owns the partition's answer to "is this tensor here?": before the partition a stage
holds everything; :meth:`StageHolding.take` applies a plan (keeps the stage's tensors on its device, releases
the rest). ``DistributedModel``'s local views and state dicts are thin calls into it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from shardkit.distributed import GroupLike
from shardkit.modelparallel.building.delayed_init import is_delayed
from shardkit.modelparallel.building.startup import canonical_tensors
from shardkit.modelparallel.checkpoints import checkpoint as ckpt
from shardkit.modelparallel.partitioning.plan import PipelinePlan


class StageHolding:
    """The share of ``module`` this stage holds; ``mp_group`` joins the stages of its replica (for state dicts)."""

    def __init__(self, module: nn.Module, mp_group: GroupLike) -> None:
        self.module = module
        self.mp_group = mp_group
        self.plan: Optional[PipelinePlan] = None
        """The applied partition plan (None before the partition)."""
        self.stage = 0
        self.device = torch.device("cpu")
        """Where this stage computes and keeps what it holds."""
        self._held: set[str] = set()
        self._key_map: dict[str, str] = {}
        # A state dict loaded before the partition into a model built inside smp.delay_param_initialization: its
        # tensors do not exist yet, so it waits (with its ``strict``) for :meth:`load_pending`.
        self._pending: Optional[tuple[dict[str, Any], bool]] = None

    @property
    def partitioned(self) -> bool:
        """True once a plan was applied."""
        return self.plan is not None

    def holds(self, name: str) -> bool:
        """Whether the canonical tensor ``name`` lives on this stage (every tensor does before the partition)."""
        return self.plan is None or name in self._held

    def holding_stages(self, name: str) -> Optional[tuple[int, ...]]:
        """The stages holding canonical tensor ``name`` (None before the partition: every stage holds all)."""
        if self.plan is None:
            return None
        return self.plan.holders.get(name, ())

    def take(self, plan: PipelinePlan, stage: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Apply ``plan``: keep this stage's tensors (moved to ``device``), release the others; returns them all.

        Released tensors become empty (their stage owns them); the canonical name -> tensor map is returned.
        """
        self._key_map = ckpt.state_key_map(self.module)
        self.device = device
        named = canonical_tensors(self.module)
        self._held = {name for name, stages in plan.holders.items() if stage in stages}
        with torch.no_grad():
            for name, tensor in named.items():
                if name in self._held:
                    if tensor.device != device:
                        tensor.data = tensor.data.to(device)
                else:  # released: its stage owns it
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                    tensor.grad = None
        self.plan, self.stage = plan, stage
        return named

    # ---- local views ----------------------------------------------------------------------------------------

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters this stage holds."""
        for name, param in self.module.named_parameters():
            if self.holds(name):
                yield name, param

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, buffer) for the buffers this stage holds."""
        for name, buf in self.module.named_buffers():
            if self.holds(name):
                yield name, buf

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) for the modules that run on this stage (all before the partition)."""
        if self.plan is None:
            yield from self.module.named_modules()
            return
        for unit, stage in self.plan.units.items():
            if stage == self.stage:
                for sub, module in self.module.get_submodule(unit).named_modules():
                    yield (f"{unit}.{sub}" if unit and sub else unit or sub), module

    def first_holder_mask(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """For each parameter, whether this stage is the lowest one holding it (see ``DistributedModel``)."""
        if self.plan is None:
            return [True] * len(params)
        names = {id(p): name for name, p in self.module.named_parameters()}
        holders = self.plan.holders
        return [min(holders.get(names.get(id(p), ""), (self.stage,))) == self.stage for p in params]

    # ---- state dicts (see checkpoint.py) ----------------------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's parameters and buffers by their module names, marked ``_smp_is_partial``."""
        full = self.module.state_dict()
        if self.plan is not None:
            full = OrderedDict((k, v) for k, v in full.items() if self._key_map.get(k, k) in self._held)
        out: dict[str, Any] = dict(full)
        out[ckpt.PARTIAL_KEY] = True
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict after the partition, gathered from every stage (collective)."""
        return self.merge_stages(self.module.state_dict())

    def held_part(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of a whole model's ``state_dict`` this stage holds (after the partition)."""
        return {k: v for k, v in state_dict.items() if self._key_map.get(k, k) in self._held}

    def as_stage_sees_it(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A whole model's ``state_dict`` as this stage's module holds it after the partition: the tensors it does
        not hold as empty ones (the shape of their placeholders); keys that name nothing in the model kept (so a
        strict load still reports them)."""
        out = dict(state_dict)
        for k, v in state_dict.items():
            if k in self._key_map and self._key_map[k] not in self._held and isinstance(v, torch.Tensor):
                out[k] = v.new_empty(0)
        return out

    def merge_stages(self, stage_state: Mapping[str, Any]) -> dict[str, Any]:
        """The whole model's state dict from each stage's state dict of its module (what it does not hold is left
        out), gathered over the replica's stages (collective)."""
        held = self.held_part(stage_state)
        held[ckpt.PARTIAL_KEY] = True
        partials = ckpt.gather_partials(held, self.mp_group, "smp_model_state_dict")
        return ckpt.merge_model_partials(partials, list(self._key_map))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool) -> Any:
        """Load a full or partial state dict (partial ones gathered first: collective over the replica)."""
        if ckpt.is_partial(state_dict):
            partials = ckpt.gather_partials(state_dict, self.mp_group, "smp_model_load_state_dict")
            keys = [k for p in partials for k in p if k != ckpt.PARTIAL_KEY]
            full: dict[str, Any] = dict(ckpt.merge_model_partials(partials, list(dict.fromkeys(keys))))
        else:
            full = dict(state_dict)
        if self.plan is None and is_delayed(self.module):
            self._check_keys(full, strict)  # wrong keys fail now, not at the first step
            self._pending = (full, strict)
            return None
        if self.plan is None:
            return self.module.load_state_dict(full, strict=strict)
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
        return None

    def load_pending(self) -> None:
        """Right after the partition: load the state dict that waited for a delayed model's tensors."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(*pending)

    def _check_keys(self, full: Mapping[str, Any], strict: bool) -> None:
        expected = set(self.module.state_dict(keep_vars=True))
        missing, unexpected = sorted(expected - set(full)), sorted(set(full) - expected)
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]} (strict=True)"
            )

    def gather_to_cpu(self) -> None:
        """Collect every stage's tensors so this rank holds the whole model, on the CPU (collective)."""
        if self.plan is not None:
            full = self.full_state_dict()
            with torch.no_grad():
                for key, tensor in self.module.state_dict(keep_vars=True).items():
                    tensor.data = full[key].detach().clone().cpu()
            self._held = set(self._key_map.values())
            self.device = torch.device("cpu")
        self.module.cpu()
