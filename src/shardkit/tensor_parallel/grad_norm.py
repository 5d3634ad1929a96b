"""Gradient clipping by the global norm of a tensor-parallel model: each split parameter counted once.

A split parameter's gradient is spread over the tensor-parallel ranks, so its contribution to the norm is the sum
of the ranks' parts; a replicated parameter (a norm's weight, a row-parallel bias) has the same gradient on every
rank and counts once. Summing every rank's whole local norm would count the replicated ones ``t`` times, and
taking each rank's local norm alone would give each rank a different clipping factor: the ranks' replicas would
drift apart. :func:`split_group` is what other packages (FSDP's clipping) ask about one parameter.

Example::

    loss.backward()
    total = clip_grad_norm_(model, max_norm=1.0)   # the norm the unsplit model's gradients have
    opt.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.collectives import all_reduce
from shardkit.tensor_parallel.sharding import modules_with_splits, split_attrs


def split_group(module: nn.Module, attr: str) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group parameter ``attr`` of ``module`` is split across, or None when it is replicated
    (or the group has one rank)."""
    split = split_attrs(module).get(attr)
    return split[1].group if split is not None and split[1].size > 1 else None


def split_groups(params: Iterable[torch.Tensor]) -> list[Optional[dist.ProcessGroup]]:
    """For each of ``params``, the tensor-parallel group it is split across, or None when it is not split.

    For code that holds parameters but not the model (an optimizer clipping by the global norm, such as
    ``OSS.clip_grad_norm``): a parameter is found in whichever live tensor-parallel layer holds it now.
    """
    owners: dict[int, dist.ProcessGroup] = {}
    for module in modules_with_splits():
        for attr, (_, tp) in split_attrs(module).items():  # read once per module: this runs at every step check
            param = getattr(module, attr, None)
            if tp.size > 1 and isinstance(param, torch.Tensor):
                owners[id(param)] = tp.group
    return [owners.get(id(p)) for p in params]


def power_sum(grads: Iterable[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Sum of ``|g|^p`` over ``grads`` (the max of ``|g|`` for ``p = inf``), as an FP32 scalar on ``device``."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        g = grad.detach().float().to(device)
        if not g.numel():
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, g.abs().max())
        else:
            total = total + g.norm(norm_type) ** norm_type
    return total


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale ``model``'s gradients so their global norm (each split parameter counted once) is at most
    ``max_norm``; returns the norm before clipping. Every tensor-parallel rank calls it.

    For a model whose parameters are plain tensors (alone, or under ``DistributedDataParallel``, whose gradients
    are already averaged). Under shardkit's FSDP use ``FullyShardedDataParallel.clip_grad_norm_``, which counts
    the split parameters the same way.
    """
    norm_type = float(norm_type)
    use_max = math.isinf(norm_type)
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params and params[0].grad is not None else torch.device("cpu")
    replicated: list[torch.Tensor] = []
    split: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            if param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            group = split_group(module, attr)
            if group is None:
                replicated.append(param.grad)
            else:
                split.setdefault(id(group), (group, []))[1].append(param.grad)
    total = power_sum(replicated, norm_type, device)
    for group, grads in split.values():
        partial = power_sum(grads, norm_type, device)
        op = dist.ReduceOp.MAX if use_max else dist.ReduceOp.SUM
        all_reduce(partial, op=op, group=group, label="tp.grad_norm")
        total = torch.maximum(total, partial) if use_max else total + partial
    total_norm = total if use_max else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for param in params:
        assert param.grad is not None
        param.grad.detach().mul_(coef.to(param.grad.device, param.grad.dtype))
    return total_norm
