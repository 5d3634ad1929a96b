"""Shared pieces of the OSS tests: a torch DDP reference and an OSS copy of one model (batches, training loops and
comparisons come from ``testkit``)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.optim import OSS
from testkit import OPTIMIZERS, tiny_model


def ddp_pair(name: str, optim: str, freeze: bool = False) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, OSS]:
    """A DDP reference with the plain optimizer and a DDP copy with OSS, from identical weights."""
    cls, kwargs = OPTIMIZERS[optim]
    base = tiny_model(name)
    if freeze:  # freeze roughly the first half of the parameter tensors
        params = list(base.parameters())
        for p in params[: len(params) // 2]:
            p.requires_grad_(False)
    ref_model, oss_model = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    ref_opt = cls(ref_model.parameters(), **kwargs)
    oss_opt = OSS(oss_model.parameters(), optim=cls, **kwargs)
    return ref_model, oss_model, ref_opt, oss_opt
