"""The cross-rank average a SlowMo checkpoint stores, computed into copies (the live model never changes).

Between synchronisations every SlowMo rank has its own parameters and optimizer state. The portable part of a
SlowMo checkpoint is their average, which every other strategy can load:

- parameters: the push-sum estimate of the average, ``sum_i x_i / sum_i w_i`` (``x_i`` the numerators, ``w_i``
  the push-sum weights; with LocalSGD or push-pull every ``w_i`` is 1 and this is the plain mean). This is what
  an exact average (SlowMo's own LocalSGD step) would give the model;
- optimizer state tensors shaped like their parameter (momentum, ``exp_avg`` ...): the mean over ranks. For SGD
  with momentum this is exactly the momentum a single process on the global batch would hold;
- everything else (step counters, scalars): this rank's own, which all ranks share;
- buffers: global rank 0's, the copy SlowMo broadcasts to every rank at the next forward.

Memory: each rank keeps only the flat range of every tensor it writes (``share``, from
:func:`~shardkit.checkpoint.universal.placement.replica_share`), so the copies of all ranks together are one model
and one optimizer state; a tensor is averaged whole (a float64 temporary the size of the largest tensor, the
bounded staging buffer) and cut at once. Every collective goes through :mod:`shardkit.distributed`; the ranks first
agree on the optimizer state's shape, so ranks holding different states raise together instead of hanging.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardkit.distributed import collectives as C
from shardkit.distributed.groups import GroupLike
from shardkit.distributed.objects import all_gather_objects

Share = tuple[int, int]


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device, copy=True)


def _cut(full: torch.Tensor, share: Share, like: torch.Tensor) -> torch.Tensor:
    """Flat elements ``share`` of ``full``, as a new tensor with ``like``'s dtype and device."""
    return full.reshape(-1)[share[0] : share[1]].to(device=like.device, dtype=like.dtype).clone()


def average_params(
    params: Sequence[torch.Tensor],
    shares: Sequence[Share],
    weight: float,
    numerators: bool,
    group: GroupLike,
    device: torch.device,
) -> list[torch.Tensor]:
    """Flat elements ``shares[i]`` of ``sum(x) / sum(w)`` over ``group`` for each parameter (``numerators``: the
    parameters hold ``x``, else ``x / w``), in each parameter's dtype and device."""
    total_weight = torch.tensor([weight], dtype=torch.float64, device=device)
    C.all_reduce(total_weight, group=group, label="checkpoint.slowmo:weights")
    out = []
    for p, share in zip(params, shares):
        x = _on(p, device).to(torch.float64)
        if not numerators:
            x.mul_(weight)
        C.all_reduce(x, group=group, label="checkpoint.slowmo:params")
        out.append(_cut(x.div_(total_weight), share, p))
    return out


def broadcast_copies(
    tensors: Sequence[torch.Tensor], shares: Sequence[Share], group: GroupLike, device: torch.device
) -> list[torch.Tensor]:
    """Flat elements ``shares[i]`` of rank 0's ``tensors[i]`` on every rank."""
    out = []
    for t, share in zip(tensors, shares):
        value = _on(t, device)
        C.broadcast(value, 0, group=group, label="checkpoint.slowmo:buffers")
        out.append(_cut(value, share, t))
    return out


def _signature(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, tuple[int, ...], str]]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sig = []
    for index, p in enumerate(params):
        for name, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                sig.append((index, str(name), tuple(value.shape), str(value.dtype)))
    return sig


def averaged_optimizer(
    optimizer: torch.optim.Optimizer,
    copy_of: Mapping[int, tuple[torch.Tensor, Share]],
    group: GroupLike,
    device: torch.device,
) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` over the share copies of its parameters (``copy_of[id(param)]``: the copy
    and its flat range), with the state averaged and cut the same way.

    State tensors with as many elements as their parameter are averaged over ``group`` and cut to the share; other
    state (step counters) is this rank's, whole. The returned optimizer is only read (its ``param_groups`` and
    ``state``); it never steps.
    """
    signatures = all_gather_objects(_signature(optimizer), group, "checkpoint.slowmo:optimizer_signature")
    if any(sig != signatures[0] for sig in signatures):
        differing = [rank for rank, sig in enumerate(signatures) if sig != signatures[0]]
        raise RuntimeError(
            f"SlowMo ranks {differing} hold optimizer state of other shapes than rank 0: every rank must step the "
            "same optimizer over the same parameters before a checkpoint"
        )
    world = len(signatures)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in copy_of for p in params):
        raise ValueError(
            "the optimizer steps a tensor that is not a parameter of the SlowMo model: build it over model.parameters()"
        )
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for p in params:
        copy_, share = copy_of[id(p)]
        for name, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == p.numel() and value.is_floating_point():
                summed = _on(value, device).to(torch.float64)
                C.all_reduce(summed, group=group, label="checkpoint.slowmo:optimizer_state")
                value = _cut(summed.div_(world), share, value)
            elif isinstance(value, torch.Tensor):
                value = value.detach().clone()
            state[copy_][name] = value
    shadow = copy.copy(optimizer)
    shadow.param_groups = [{**g, "params": [copy_of[id(p)][0] for p in g["params"]]} for g in optimizer.param_groups]
    shadow.state = state
    return shadow
